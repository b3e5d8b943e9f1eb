"""Immutable text keys and composite link rows: copy what is new, compare what is not.

**Text keys** (``Key.TEXT``: ULIDs and content hashes - ``responses.id``,
``calls.id``, ``attachments.id``, ``threads.id``, ...): a row whose key the
target lacks is copied; a key on both sides with *different* content is a
conflict, reported before anything is written. ``Table.compare`` says which
columns count as content (``()``: none, as for ``_llm_migrations``, whose
``applied_at`` differs by file); a mutable pointer is not content
(``pointers.py`` decides it).

**Composite keys** (``Key.COMPOSITE``: ``prompt_attachments``,
``turn_fragments``, ...): a link row is all key. It is inserted, its
references rewritten into the target's keys, unless the target has it.
"""

from __future__ import annotations

from dagsync.formats import Key, Table
from dagsync.merge import origins
from dagsync.merge.core import MAX_CONFLICTS_SHOWN, SourceMerge, quoted
from dagsync.merge.maps import differs, expr, key_match
from dagsync.merge.references import dangling_sql

__all__ = ["apply", "plan"]


def plan(run: SourceMerge, table: Table) -> None:
    """Count the rows whose key is new; compare the rest, listing each one that differs."""
    name = table.name
    key = table.natural_key
    compare = table.compare
    if compare is None:
        compare = tuple(c for c in run.columns[name] if c not in key and c != table.pointer)
    if table.key is not Key.TEXT:
        compare = ()  # a composite row is all key
    match = key_match(run, table)
    differ = " OR ".join(differs(run, table, c) for c in compare) or "0"
    # The same pass counts new rows with a reference that resolves nowhere
    # (see references.check_dangling, which names one only if there are any).
    dangles = dangling_sql(run, table)
    # A key with a NULL in it is matched by IS, which no unique index does (see apply).
    null_key = " OR ".join(f's."{k}" IS NULL' for k in key)
    added = existing = dangling = null_keys = 0
    for low, high in run.chunks(f'src."{name}"'):
        new, old, conflicting, bad, nulls = next(iter(run.conn.execute(
            f"SELECT count(*) - count(t.rowid), count(t.rowid), "
            f"coalesce(sum(t.rowid IS NOT NULL AND ({differ})), 0), "
            f"coalesce(sum(CASE WHEN t.rowid IS NULL THEN ({dangles}) ELSE 0 END), 0), "
            f"coalesce(sum({null_key}), 0) "
            f'FROM src."{name}" s LEFT JOIN main."{name}" t ON {match} WHERE s.rowid BETWEEN ? AND ?',
            (low, high),
        )))  # fmt: skip
        added, existing, dangling, null_keys = added + new, existing + old, dangling + bad, null_keys + nulls
        if conflicting and len(run.conflicts) < MAX_CONFLICTS_SHOWN * 10:
            for (k,) in run.conn.execute(
                f'SELECT s."{key[0]}" FROM src."{name}" s JOIN main."{name}" t ON {match} '
                f"WHERE s.rowid BETWEEN ? AND ? AND ({differ}) LIMIT ?",
                (low, high, MAX_CONFLICTS_SHOWN),
            ):
                run.conflict(f"{name} {k} differs between the two files")
    counts = run.counts[name]
    counts.added, counts.existing = added, existing
    run.dangling_counted[name] = dangling
    run.upsert.discard(name)
    if not null_keys and _unique_on(run, "main", table) and _unique_on(run, "src", table):
        run.upsert.add(name)


def _unique_on(run: SourceMerge, schema: str, table: Table) -> bool:
    """Whether ``schema``'s ``table`` has a unique index on exactly its key, in
    SQLite's own (binary) order, and not partial: then two rows of one key
    cannot both be there, and an insert can be told to skip the keys there."""
    key = set(table.natural_key)
    for _, index, unique, _, partial in run.conn.execute(f'PRAGMA {schema}.index_list("{table.name}")'):
        if not unique or partial:
            continue
        columns = [
            (col, coll)
            for _, _, col, _, coll, is_key in run.conn.execute(f'PRAGMA {schema}.index_xinfo("{index}")')
            if is_key
        ]
        if {col for col, _ in columns} == key and len(columns) == len(key):
            if all(coll == "BINARY" for _, coll in columns):
                return True
    return False


def apply(run: SourceMerge, table: Table) -> None:
    """Insert the rows whose key the target lacks, their references in the target's keys."""
    if not run.counts[table.name].added:
        return  # nothing to copy: no write transaction at all
    name = table.name
    select = ", ".join(expr(run, table, col, written=True) for col in run.columns[name])
    match = key_match(run, table)
    if name in run.upsert:
        # A statement that reads the table it inserts into first stores every
        # row it selects in a temp table (prompts and responses: hundreds of
        # MB per chunk, a large attachment twice in memory); skipping the keys
        # there by the key's own unique index reads only the source. Only
        # where both files have that index, and no key holds a NULL (which IS
        # matches and an index does not: keyed.plan).
        skip = f"ON CONFLICT ({quoted(table.natural_key)}) DO NOTHING"
    else:
        skip = f'AND NOT EXISTS (SELECT 1 FROM main."{name}" t WHERE {match})'
    for low, high in run.chunks(f'src."{name}"', phase=f"copying {name}", writes=True):
        with run.writer.transaction():
            # A pointer's rows copied here are those above the highest rowid now (origins).
            since = run.one(f'SELECT coalesce(max(rowid), 0) FROM main."{name}"') if table.pointer else 0
            run.conn.execute(
                f'INSERT INTO main."{name}" ({run.column_list(table)}) SELECT {select} '
                f'FROM src."{name}" s WHERE s.rowid BETWEEN ? AND ? {skip}',
                (low, high),
            )
            copied = run.changes()
            run.written[name].added += copied
            if copied and table.pointer:
                origins.record_new(run, table, since)
