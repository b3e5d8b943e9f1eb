"""Integer surrogate keys: never copy the number; match by natural key, else renumber.

``fragments``, ``tools``, ``tool_instances``, ``tool_calls``,
``tool_results``, the legacy ``parts``, and in the llm format ``parts`` and
``turn_search``: the same id means different rows in different files. Each
source row is matched with a target row by the table's natural key (its
references rewritten into the target's keys first), into ``temp."map_<table>"
(src, dst, new)``; a row with no match is new and gets, when applied, an id
after the target's highest, taken under the write lock. Every reference to
the table then follows the map: columns and ids inside JSON (``maps.py``).

Two ways to match:

* the target keeps the natural key unique (``fragments.hash``, llm
  ``parts (message_hash, position)``, ...): each source row is looked up by
  it directly, in key order;
* otherwise equal rows are matched by rank: the k-th source row with a
  natural key (in id order) is the k-th target row with it. Two identical
  tool calls in one response stay two rows, and a merge cut short after
  copying the first copies only the second when re-run.
"""

from __future__ import annotations

from dagsync.formats import Key, Table
from dagsync.merge.core import SourceMerge, quoted
from dagsync.merge.maps import expr
from dagsync.merge.references import dangling_sql

__all__ = ["apply", "plan"]


def plan(run: SourceMerge, table: Table) -> None:
    """Fill ``temp."map_<table>"``: each source id -> the target's id, or a placeholder for a new row."""
    c = run.conn
    name = table.name
    nk = run.natural_key(table)
    keys = quoted(nk)
    # "bad": a new row with a reference that resolves nowhere (where counted, see references).
    c.execute(
        f'CREATE TEMP TABLE "map_{name}" (src INTEGER PRIMARY KEY, dst INTEGER, new INTEGER NOT NULL, bad INTEGER)'
    )
    if _unique_in_target(run, name, nk):
        _plan_unique(run, table, nk)
        return
    ranked = f"row_number() OVER (PARTITION BY {keys} ORDER BY id)"
    # The source's keys (rewritten into the target's terms) and the target's
    # copied into indexed temp tables, read in bounded slices.
    c.execute(
        f'CREATE TEMP TABLE "sk_{name}" (seq INTEGER PRIMARY KEY, id INTEGER NOT NULL, '
        f"{keys}, rnk INTEGER DEFAULT 1)"
    )
    mapped = ", ".join(expr(run, table, k) for k in nk)
    for low, high in run.chunks(f'src."{name}"', "id"):
        c.execute(
            f'INSERT INTO temp."sk_{name}" (id, {keys}) SELECT s.id, {mapped} FROM src."{name}" s '
            "WHERE s.id BETWEEN ? AND ? ORDER BY s.id",
            (low, high),
        )
    c.execute(f'CREATE TEMP TABLE "tk_{name}" AS SELECT id, {keys}, 1 AS rnk FROM main."{name}" WHERE 0')
    if _target_may_match(run, table, nk):
        for low, high in run.chunks(f'main."{name}"', "id"):
            c.execute(
                f'INSERT INTO temp."tk_{name}" SELECT id, {keys}, 1 FROM main."{name}" WHERE id BETWEEN ? AND ?',
                (low, high),
            )
    for side in ("tk", "sk"):
        # Every rank is 1 unless a key repeats (rare): only then count them.
        if run.one(f'SELECT 1 FROM temp."{side}_{name}" GROUP BY {keys} HAVING count(*) > 1 LIMIT 1'):
            c.execute(
                f'UPDATE temp."{side}_{name}" SET rnk = r.n FROM (SELECT id, {ranked} AS n '
                f'FROM temp."{side}_{name}") r WHERE "{side}_{name}".id = r.id'
            )
    c.execute(f'CREATE INDEX temp."tk_{name}_nk" ON "tk_{name}" ({keys}, rnk)')
    same = " AND ".join(f't."{k}" IS s."{k}"' for k in nk)
    # A new row's placeholder (-seq) is below every real id, so nothing
    # that refers to it can match a target row until apply gives it an id.
    c.execute(
        f'INSERT INTO temp."map_{name}" (src, dst, new) SELECT s.id, coalesce(m, -s.seq), m IS NULL FROM '
        f'(SELECT s.id, s.seq, (SELECT t.id FROM temp."tk_{name}" t WHERE {same} AND t.rnk = s.rnk) AS m '
        f'FROM temp."sk_{name}" s) s'
    )
    _count(run, name)


def _target_may_match(run: SourceMerge, table: Table, nk: tuple[str, ...]) -> bool:
    """Whether any target row can share a natural key with a source row. A thin
    source (a delta) holds few rows, mostly of rows new to the target: when its
    first key column refers to rows the target lacks (the new responses of new
    tool calls), none can, and the target's table is not read at all."""
    name = table.name
    if not run.one(f'SELECT 1 FROM temp."sk_{name}" LIMIT 1'):
        return False
    ref = run.fmt.references[name].get(nk[0])
    if not run.thin or ref is None or run.fmt.table(ref).key is not Key.TEXT:
        return True
    ref_key = run.fmt.table(ref).natural_key[0]
    return bool(run.one(
        f'SELECT 1 FROM temp."sk_{name}" s WHERE s."{nk[0]}" IS NULL OR EXISTS '
        f'(SELECT 1 FROM main."{ref}" r WHERE r."{ref_key}" = s."{nk[0]}") LIMIT 1'
    ))  # fmt: skip


def _count(run: SourceMerge, name: str) -> None:
    counts = run.counts[name]
    counts.added = run.one(f'SELECT count(*) FROM temp."map_{name}" WHERE new')
    counts.mapped = run.one(f'SELECT count(*) FROM temp."map_{name}" WHERE NOT new AND dst != src')
    counts.existing = run.one(f'SELECT count(*) FROM temp."map_{name}" WHERE NOT new AND dst = src')


def _unique_in_target(run: SourceMerge, table: str, columns: tuple[str, ...]) -> bool:
    """The target has a unique index on exactly these columns."""
    for _, index, unique, *_ in list(run.conn.execute(f'SELECT * FROM main.pragma_index_list("{table}")')):
        if unique and tuple(
            row[2] for row in run.conn.execute("SELECT * FROM main.pragma_index_info(?)", (index,))
        ) == tuple(columns):
            return True
    return False


def _plan_unique(run: SourceMerge, table: Table, nk: tuple[str, ...]) -> None:
    """A natural key the target keeps unique: look each source row up by it directly."""
    name = table.name
    low_id = run.one(f'SELECT coalesce(min(id), 0) FROM src."{name}"')
    same = " AND ".join(f't."{k}" IS {expr(run, table, k)}' for k in nk)
    found = f'(SELECT t.id FROM main."{name}" t WHERE {same})'
    # In natural-key order, so the lookups walk the target's unique index
    # in order; chunks of equal first-key values stay together.
    first = nk[0]
    # The same pass marks new rows whose references resolve nowhere.
    dangles = dangling_sql(run, table)
    insert = (
        f'INSERT INTO temp."map_{name}" (src, dst, new, bad) SELECT id, coalesce(m, ? - 1 - id), m IS NULL, '
        f"CASE WHEN m IS NULL THEN bad END FROM (SELECT s.id, {found} AS m, ({dangles}) AS bad "
        f'FROM src."{name}" s WHERE s.id <= ? AND '
    )
    for low, high in run.chunks(f'src."{name}"', f'"{first}"'):
        # Placeholders -1, -2, ... for new rows, below every real id.
        run.conn.execute(
            insert + f's."{first}" BETWEEN ? AND ? ORDER BY s."{first}")',
            (low_id, run.bounds.get(name, 0), low, high),
        )
    # A NULL first key is in no range above.
    run.conn.execute(insert + f's."{first}" IS NULL)', (low_id, run.bounds.get(name, 0)))
    _count(run, name)
    run.dangling_counted[name] = run.one(f'SELECT count(*) FROM temp."map_{name}" WHERE bad')


def apply(run: SourceMerge, table: Table) -> None:
    """Insert the new rows under new ids, after the target's highest, taken under the write lock."""
    if not run.counts[table.name].added:
        return  # nothing to copy: no write transaction at all
    c = run.conn
    name = table.name
    select = ", ".join("m.dst" if col == "id" else expr(run, table, col, written=True) for col in run.columns[name])
    for low, high in run.chunks(f'temp."map_{name}"', "src", f"copying {name}", writes=True):
        with run.writer.transaction():
            base = run.one(f'SELECT coalesce(max(id), 0) FROM main."{name}"')
            c.execute(
                f'UPDATE temp."map_{name}" SET dst = ? + r.n FROM (SELECT src, row_number() OVER '
                f'(ORDER BY src) AS n FROM temp."map_{name}" WHERE new AND src BETWEEN ? AND ?) r '
                f'WHERE "map_{name}".src = r.src',
                (base, low, high),
            )
            c.execute(
                f'INSERT INTO main."{name}" ({run.column_list(table)}) SELECT {select} '
                f'FROM temp."map_{name}" m JOIN src."{name}" s ON s.id = m.src '
                "WHERE m.new AND m.src BETWEEN ? AND ? ORDER BY m.src",
                (low, high),
            )
            run.written[name].added += run.changes()
