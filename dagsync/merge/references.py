"""The dangling-reference checks: no copied row may point at nothing.

A source is untrusted. Before anything is written, every reference held by a
row about to be copied must resolve: a reference to a message or to an
integer-keyed row through the plan's maps (the source must have that row),
one to a text key in the source or in the target. The first that does not
is named and the source is refused (``DamagedSource``). The kinds' plans
count such rows in the pass that compares or maps them (``dangling_sql``),
so the pass that names one runs only when there is one.
"""

from __future__ import annotations

from dagsync import bookkeeping
from dagsync.errors import DamagedSource, UnresolvedReference
from dagsync.forget import tombstones
from dagsync.formats import Key, Table
from dagsync.merge.core import MESSAGE_KEYS, SourceMerge
from dagsync.merge.maps import expr, key_match, payload

__all__ = ["check_dangling", "dangling_sql", "is_new"]

Check = tuple[str, str, str, str]  # column, referenced table, SQL true when it dangles, why


def is_new(run: SourceMerge, table: Table) -> str:
    """SQL true for a source row ``s`` that the merge will insert."""
    # EXISTS, not IN (SELECT ...): SQLite then looks each row up, instead
    # of walking the whole new-message list for every chunk.
    if table.key in MESSAGE_KEYS:
        return f"EXISTS (SELECT 1 FROM temp.msg_new n WHERE n.src = s.{run.fmt.message_key})"
    if table.owner is not None:
        return f'EXISTS (SELECT 1 FROM temp.msg_new n WHERE n.src = s."{table.owner[0]}")'
    if table.key is Key.INTEGER:
        return f'(SELECT new FROM temp."map_{table.name}" WHERE src = s.id)'
    return f'NOT EXISTS (SELECT 1 FROM main."{table.name}" t WHERE {key_match(run, table)})'


def check_dangling(run: SourceMerge, table: Table) -> None:
    """Refuse the source if a row of ``table`` about to be copied holds a
    reference that resolves nowhere; it would dangle in the target.

    :raises DamagedSource: naming the first such reference.
    """
    if not run.counts[table.name].added:
        return  # no row of it is copied (fork rows point where the source's row did)
    checks = _checks(run, table)
    if checks and run.dangling_counted.get(table.name) != 0:
        _find(run, table, checks)
    _check_json_refs(run, table)


def dangling_sql(run: SourceMerge, table: Table) -> str:
    """SQL true for a source row ``s`` with a reference that resolves nowhere."""
    return " OR ".join(f for _, _, f, _ in _checks(run, table)) or "0"


def _checks(run: SourceMerge, table: Table) -> list[Check]:
    """Each reference a copied row of ``table`` must resolve."""
    checks: list[Check] = []
    for column, ref in run.fmt.references[table.name].items():
        ref_table = run.fmt.table(ref)
        if ref == table.name and ref_table.key in MESSAGE_KEYS:
            continue  # parent links: messages.plan checked them
        if table.owner is not None and column == table.owner[0]:
            continue  # the rows checked are those of new owners: this resolves
        if ref_table.key in MESSAGE_KEYS or ref_table.key is Key.INTEGER:
            # Mapped from the source's own rows: the source must have the row.
            fails = f"{expr(run, table, column, written=True)} IS NULL"
            why = f"which {run.source.name} does not have"
            if run.thin:
                why = f"which neither {run.source.name} nor {run.db.path.name} has"
        else:
            ref_key = ref_table.natural_key[0]
            in_source = (
                f'EXISTS (SELECT 1 FROM src."{ref}" r WHERE r."{ref_key}" = s."{column}")'
                if run.present(ref_table)
                else "0"
            )
            in_target = f'EXISTS (SELECT 1 FROM main."{ref}" r WHERE r."{ref_key}" = s."{column}")'
            fails = f"NOT ({in_source} OR {in_target}{_forgotten(run, ref, column)})"
            why = "which neither file has"
        checks.append((column, ref, f'(s."{column}" IS NOT NULL AND {fails})', why))
    return checks


def _forgotten(run: SourceMerge, ref: str, column: str) -> str:
    """SQL (`` OR ...``) true when ``s.column`` names a conversation either file forgot:
    a fork made through llm's API keeps its ``forked_from`` to a thread since
    forgotten (dagsync/forget), which resolves that way."""
    spec = run.fmt.conversations
    if spec is None or ref not in spec.tables:
        return ""
    return "".join(
        f' OR EXISTS (SELECT 1 FROM {schema}.{tombstones.FORGOTTEN} f WHERE f.key = s."{column}")'
        for schema in ("src", "main")
        if bookkeeping.has(run.conn, tombstones.FORGOTTEN, schema)
    )


def _find(run: SourceMerge, table: Table, checks: list[Check]) -> None:
    """Raise ``DamagedSource`` naming the first reference that resolves nowhere."""
    failing = " OR ".join(f for _, _, f, _ in checks)
    values = ", ".join(f's."{col}", {f}' for col, _, f, _ in checks)
    if table.owner is not None:
        # Only the rows of new messages are copied: walk those alone.
        rows, slices = (
            f'temp.msg_new n JOIN src."{table.name}" s ON s."{table.owner[0]}" = n.src '
            "WHERE n.seq BETWEEN ? AND ?",
            run.chunks("temp.msg_new", "seq"),
        )
    else:
        rows, slices = (
            f'src."{table.name}" s WHERE s.rowid BETWEEN ? AND ? AND {is_new(run, table)}',
            run.chunks(f'src."{table.name}"'),
        )
    for low, high in slices:
        for row in run.conn.execute(f"SELECT {values} FROM {rows} AND ({failing}) LIMIT 1", (low, high)):
            for i, (column, ref, _, why) in enumerate(checks):
                if row[2 * i + 1]:
                    detail = f"{table.name}.{column} refers to {ref} {row[2 * i]!r}"
                    message = f"{run.source}: {detail}, {why}; nothing was merged - run `dagsync verify` on the source"
                    raise UnresolvedReference(message, detail) if run.thin else DamagedSource(message)


def _check_json_refs(run: SourceMerge, table: Table) -> None:
    """Ids inside a JSON column of a copied row must be mapped, as columns are."""
    for json_ref in table.json_refs:
        piece = f"j.value ->> '$.{json_ref.id_key}'"
        value = payload(run, table, json_ref.column)
        for low, high in run.chunks(f'src."{table.name}"'):
            for (bad,) in run.conn.execute(
                f'SELECT {piece} FROM src."{table.name}" s, '
                f"json_each({value}, '$.{json_ref.list_key}') j "
                f"WHERE s.rowid BETWEEN ? AND ? AND {value} LIKE '%\"{json_ref.list_key}\"%' "
                f"AND {is_new(run, table)} AND {piece} IS NOT NULL AND NOT EXISTS "
                f'(SELECT 1 FROM temp."map_{json_ref.table}" m WHERE m.src = {piece}) LIMIT 1',
                (low, high),
            ):
                raise DamagedSource(
                    f"{run.source}: a {table.name}.{json_ref.column} refers to {json_ref.table} {bad!r}, "
                    f"which {run.source.name} does not have; nothing was merged - run `dagsync verify` on the source"
                )
