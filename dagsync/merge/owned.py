"""Owned rows: copied only with the row they belong to, and only when that row is new.

The dag format's ``message_parts`` (``Table.owner = ("message_id",
"messages")``): a message's parts are part of its content (its
``content_hash`` covers them), so a message the target already has, or one
mapped onto another row, brings none; a new message brings all of its own,
inserted in the same transaction as the message (``messages.apply`` calls
``copy``), so no commit point holds a message without its parts. A part
whose key the target already holds for another message is a conflict.
"""

from __future__ import annotations

from dagsync.formats import Table
from dagsync.merge.core import MAX_CONFLICTS_SHOWN, SourceMerge
from dagsync.merge.maps import payload

__all__ = ["apply", "copy", "plan"]


def plan(run: SourceMerge, table: Table) -> None:
    """Rows that travel with their owner: counted for new owners, checked for clashes."""
    column, _ = table.owner  # type: ignore[misc]
    key = table.natural_key[0]
    added = 0
    rows = f'temp.msg_new n JOIN src."{table.name}" s ON s."{column}" = n.src'
    for low, high in run.chunks("temp.msg_new", "seq"):
        # One pass counts them and the ones whose key the target has.
        count, clashes = next(iter(run.conn.execute(
            f'SELECT count(*), count(t."{key}") FROM {rows} LEFT JOIN main."{table.name}" t '
            f'ON t."{key}" = s."{key}" WHERE n.seq BETWEEN ? AND ?',
            (low, high),
        )))  # fmt: skip
        added += count
        if not clashes:
            continue
        for (clash,) in run.conn.execute(
            f'SELECT s."{key}" FROM {rows} JOIN main."{table.name}" t ON t."{key}" = s."{key}" '
            "WHERE n.seq BETWEEN ? AND ? LIMIT ?",
            (low, high, MAX_CONFLICTS_SHOWN),
        ):
            run.conflict(f"{table.name} {clash} belongs to a new message but is already in the target")
    run.counts[table.name].added = added


def apply(run: SourceMerge, table: Table) -> None:
    """Nothing of its own: the rows are copied with their owner (``copy``)."""


def copy(run: SourceMerge, table: Table, low: int, high: int) -> None:
    """Insert the rows of the new owners ``temp.msg_new`` numbers ``low``..``high``,
    inside the owners' own write transaction."""
    column = table.owner[0]  # type: ignore[index]
    run.conn.execute(
        f'INSERT INTO main."{table.name}" ({run.column_list(table)}) '
        f'SELECT {", ".join(payload(run, table, col) for col in run.columns[table.name])} '
        f'FROM temp.msg_new n JOIN src."{table.name}" s ON s."{column}" = n.src '
        "WHERE n.seq BETWEEN ? AND ?",
        (low, high),
    )
    run.written[table.name].added += run.changes()
