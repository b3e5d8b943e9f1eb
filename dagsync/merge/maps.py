"""How a source column becomes a target value: read through the plan's maps.

Every reference a source row holds is rewritten into the target's keys as it
is compared or copied, in SQL:

* a reference to a **message** goes through ``temp.msg_map`` (written) or
  ``temp.msg_moved`` (compared: only messages mapped onto another row move);
* a reference to an **integer-keyed** row goes through ``temp."map_<table>"``;
* integer ids **inside JSON** (llm's ``parts.payload``, ``{"text_ref":
  [{"fragment": 12}, ...]}``) go through the same maps, by a SQL function that
  rewrites the JSON (``JsonRef.rewrite``) - only for values that can hold one;
* a packed source's **blob references** are resolved to the payload's exact
  bytes (a packed target packs them again after the merge).

Everything else is copied as it is.
"""

from __future__ import annotations

from dagsync import bookkeeping, packed
from dagsync.errors import DamagedSource
from dagsync.formats import JsonRef, Key, PackedColumn, Table
from dagsync.merge.branches import family
from dagsync.merge.core import MESSAGE_KEYS, SourceMerge

__all__ = ["differs", "expr", "key_match", "payload"]


def expr(run: SourceMerge, table: Table, column: str, alias: str = "s", written: bool = False) -> str:
    """SQL for ``column`` of a source row, rewritten into the target's keys.

    ``written``: the value is written to the target. A reference to a
    message then comes from the plan's map, so a message the plan did not
    see (a live source's row changed since) is NULL, never dangling.
    """
    ref = run.fmt.references[table.name].get(column)
    if ref is not None and ref != table.name:
        ref_table = run.fmt.table(ref)
        if ref_table.key in MESSAGE_KEYS and written:
            return f'(SELECT dst FROM temp.msg_map WHERE src = {alias}."{column}")'
        if ref_table.key in MESSAGE_KEYS:
            # To compare or match: only messages mapped onto another row
            # move; most keep their id (the dangling checks see the source has them).
            raw = f'{alias}."{column}"'
            if not run.moved:
                return raw
            return f"coalesce((SELECT dst FROM temp.msg_moved WHERE src = {raw}), {raw})"
        if ref_table.key is Key.INTEGER:
            return f'(SELECT dst FROM temp."map_{ref}" WHERE src = {alias}."{column}")'
    value = payload(run, table, column, alias)
    if run.branches and table.name == run.fmt.call_table and column == run.fmt.call_conversation:
        # A call follows its branch: onto a fork, where branches.plan said so.
        return f'coalesce((SELECT conv FROM temp.branch WHERE call = {alias}."{table.natural_key[0]}"), {value})'
    for json_ref in table.json_refs:
        if json_ref.column == column:
            # Only JSON that can hold ids goes through Python.
            return (
                f"CASE WHEN {value} LIKE '%\"{json_ref.list_key}\"%' "
                f"THEN {_json_function(run, json_ref)}({value}) ELSE {value} END"
            )
    return value


def payload(run: SourceMerge, table: Table, column: str, alias: str = "s") -> str:
    """SQL for a source column as llm wrote it: a packed source's blob references
    resolved (a packed target packs them again after the merge)."""
    column_packed = run.packed_columns.get((table.name, column))
    value = f'{alias}."{column}"'
    if column_packed is not None and run.source_packed:
        # Only references go through Python; CAST keeps the payload's exact bytes.
        kind = "TEXT" if column_packed.holds == "text" else "BLOB"
        return (
            f"CASE WHEN {packed.marker_sql(column_packed, alias)} "
            f"THEN CAST(dagsync_unpack_src({value}, '{column_packed.holds}') AS {kind}) ELSE {value} END"
        )
    return value


def _json_function(run: SourceMerge, json_ref: JsonRef) -> str:
    """A SQL function rewriting ``json_ref``'s ids through the referenced table's map."""
    name = f"dagsync_remap_{json_ref.table}"

    def new_id(old: int) -> int:
        dst = run.one(f'SELECT dst FROM temp."map_{json_ref.table}" WHERE src = ?', (old,))
        if dst is None or dst < 0:
            raise DamagedSource(f"{run.source}: a {json_ref.column} refers to {json_ref.table} {old}, which is not mapped")
        return dst

    run.conn.create_scalar_function(name, lambda text: json_ref.rewrite(text, new_id), 1)
    return name


def differs(run: SourceMerge, table: Table, column: str) -> str:
    """SQL true when target row ``t`` holds another ``column`` than source row ``s``
    (as it will hold it: a target call this merge moves onto a fork, moved)."""
    value = expr(run, table, column)
    if column == "name" and table.name == run.fmt.conversation_table and table.pointer:
        # A fork's name says which file its branch came from, and the same
        # branch may arrive from files of other names: the target's stays.
        key = table.natural_key[0]
        forks = []
        if "forked_from" in run.columns[table.name]:
            forks.append('t."forked_from" IS NOT NULL')
        if bookkeeping.has(run.conn, "_dagsync_forks"):
            forks.append(f'EXISTS (SELECT 1 FROM main._dagsync_forks f WHERE f.fork_key = t."{key}")')
        if forks:
            return f'(t."name" IS NOT {value} AND NOT ({" OR ".join(forks)}))'
    if table.name == run.fmt.call_table and column == run.fmt.call_conversation:
        # The target's call, where this merge leaves it, on the source's
        # conversation or on another row of its family: which row of a
        # family holds a call is the branches' rule, not the call's content.
        key = table.natural_key[0]
        held = f't."{column}"'
        if run.branches:
            held = f'coalesce((SELECT conv FROM temp.tmove WHERE call = t."{key}"), {held})'
        if run.families:
            return f"({held} IS NOT {value} AND {family(held)} IS NOT {family(value)})"
        return f"{held} IS NOT {value}"
    packed_column = run.packed_columns.get((table.name, column))
    if packed_column is not None and run.target_packed:
        return _differs_packed(packed_column, value, run.source_packed)
    raw = f's."{column}"'
    ref = run.fmt.references[table.name].get(column)
    if value == raw or ref is None or run.fmt.table(ref).key not in MESSAGE_KEYS:
        return f't."{column}" IS NOT {value}'
    # A message keeps its id in every file unless mapped, and the target
    # holds no reference to a message it lacks: the map is only asked when
    # the raw values differ. (Not so for integer ids, which are per file.)
    return f'CASE WHEN t."{column}" IS {raw} THEN 0 ELSE t."{column}" IS NOT {value} END'


def _differs_packed(column: PackedColumn, value: str, source_packed: bool) -> str:
    """``differs`` for a packed column of a packed target, whose value may be a
    blob reference: the blob's key is the sha256 of the payload's bytes, so a
    payload is compared with it by its hash, never decompressed; two
    references (of a packed source), by key. (A packed value only ever holds
    what pack packs: a value of the column's own storage class.)"""
    t_value = f't."{column.column}"'
    t_ref = packed.marker_sql(column, "t")
    key = packed.blob_hash_sql(column, "t")
    # Two references are compared by key: either may be the first store's form.
    s_ref, s_key = packed.marker_sql(column, "s"), packed.blob_hash_sql(column, "s")
    both = f"WHEN {t_ref} AND {s_ref} THEN {key} IS NOT {s_key} " if source_packed else ""
    return (
        f"CASE {both}"
        f"WHEN {t_ref} THEN NOT (typeof({value}) = '{column.holds}' AND {key} = dagsync_sha256(CAST({value} AS BLOB))) "
        f"ELSE {t_value} IS NOT {value} END"
    )


def key_match(run: SourceMerge, table: Table, target_alias: str = "t") -> str:
    """SQL true when the target row ``target_alias`` has the source row's key."""
    return " AND ".join(f'{target_alias}."{k}" IS {expr(run, table, k)}' for k in table.natural_key)
