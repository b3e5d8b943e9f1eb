"""Origins: which file each conversation's head came from, for fork names.

A fork row is named after the file its branch came from (``pointers``). For
the source's branch that is the source's label (``core.source_label``, or
merge's ``--label``); for the target's own branch it is the target's label,
unless the branch arrived there by an earlier merge. So every merge records,
in ``_dagsync_origins``, the head it gave a row (a row it copied new, a head
it moved on, a fork it added) and the label of the file that head came from.
A record holds only while the row still points at that head: once llm
continues the conversation, the branch is this file's own again.

The label a source's record gives is carried on, so a branch merged from a
laptop into a server and from there into a desktop is still the laptop's.
A record that no longer holds (a head gc or canonicalise changed) is only a
name lost: the fork is named after the file holding the branch.
"""

from __future__ import annotations

from dagsync import bookkeeping
from dagsync.formats import Table
from dagsync.merge.core import SourceMerge

__all__ = ["label_sql", "record", "record_moved", "record_new"]


def label_sql(run: SourceMerge, schema: str, table: Table, key: str, head: str) -> str:
    """SQL for the label ``schema``'s record gives the row ``key`` at ``head``; NULL if none holds."""
    if not bookkeeping.has(run.conn, "_dagsync_origins", schema):
        return "NULL"
    return (
        f"(SELECT o.label FROM {schema}._dagsync_origins o WHERE o.pointer_table = '{table.name}' "
        f"AND o.key = {key} AND o.head = {head})"
    )


def record_new(run: SourceMerge, table: Table, since: int) -> None:
    """Record where the heads of the rows just copied (target rowid above ``since``) came
    from, and carry on the source's record of those that are forks (``_dagsync_forks``:
    the dag format has no ``forked_from`` to say so). Call inside the transaction that
    copied them."""
    name, pointer, key = table.name, table.pointer, table.natural_key[0]
    carried = label_sql(run, "src", table, f's."{key}"', f's."{pointer}"')
    bookkeeping.ensure(run.conn)
    if bookkeeping.has(run.conn, "_dagsync_forks", "src"):
        run.conn.execute(
            "INSERT OR IGNORE INTO main._dagsync_forks (pointer_table, key, head, fork_key) "
            "SELECT f.pointer_table, f.key, f.head, f.fork_key FROM src._dagsync_forks f "
            f'JOIN main."{name}" t ON t."{key}" = f.fork_key WHERE f.pointer_table = ? AND t.rowid > ?',
            (name, since),
        )
    run.conn.execute(
        f"INSERT OR REPLACE INTO main._dagsync_origins (pointer_table, key, head, label) "
        f'SELECT ?, t."{key}", t."{pointer}", coalesce({carried}, ?) FROM main."{name}" t '
        f'JOIN src."{name}" s ON s."{key}" = t."{key}" WHERE t.rowid > ? AND t."{pointer}" IS NOT NULL',
        (name, run.label, since),
    )


def record_moved(run: SourceMerge, table: Table, verdict: int, row: str = "row") -> None:
    """Record the heads that the rows of ``verdict`` in ``temp.ptr`` moved on to (its column
    ``row`` names the row moved, to ``s_head``). Call inside the transaction that moved them."""
    carried = label_sql(run, "src", table, "p.key", "p.s_raw")
    bookkeeping.ensure(run.conn)
    run.conn.execute(
        "INSERT OR REPLACE INTO main._dagsync_origins (pointer_table, key, head, label) "
        f"SELECT ?, p.{row}, p.s_head, coalesce({carried}, ?) FROM temp.ptr p WHERE p.verdict = ?",
        (table.name, run.label, verdict),
    )


def record(run: SourceMerge, table: Table, row: str, head: str, label: str) -> None:
    """Record that ``row`` points at ``head``, from the file called ``label`` (a fork
    the merge added). Call inside the transaction that wrote it."""
    bookkeeping.ensure(run.conn)
    run.conn.execute(
        "INSERT OR REPLACE INTO main._dagsync_origins (pointer_table, key, head, label) VALUES (?, ?, ?, ?)",
        (table.name, row, head, label),
    )
