"""Walking a source's message chains, in SQL: one step up, and a message's key in the target.

A source's chain is read from its own rows; a thin source's (a delta,
``merge.delta``) goes on in the target where its rows end, through the
messages ``messages.plan`` found there (``BOUNDARY`` in ``temp.msg_map``).
"""

from __future__ import annotations

from dagsync.merge.core import BOUNDARY, TOP, SourceMerge

__all__ = ["in_target", "step_up"]


def step_up(run: SourceMerge, up: str = "up") -> tuple[str, str]:
    """One step up a source message's chain from ``<up>.cur``: (the joins and
    condition to follow ``FROM <up>``, SQL for the next message's key).

    A thin source's chain goes on in the target where the source's rows end.
    """
    mkey, parent, root = run.fmt.message_key, run.fmt.parent_column, run.fmt.root_id
    if not run.thin:
        not_root = f"m.{mkey} != '{root}'" if root else "1"
        return f"JOIN src.messages m ON m.{mkey} = {up}.cur WHERE {not_root}", f"m.{parent}"
    above = "s.parent_id" if root == TOP else f"NULLIF(s.parent_id, '{TOP}')"
    return (
        f"LEFT JOIN temp.src_msg s ON s.id = {up}.cur "
        f"LEFT JOIN temp.msg_map b ON s.id IS NULL AND b.src = {up}.cur AND b.kind = {BOUNDARY} "
        f"LEFT JOIN main.messages m ON s.id IS NULL AND m.{mkey} = coalesce(b.dst, {up}.cur) "
        f"WHERE (s.id IS NOT NULL OR m.{mkey} IS NOT NULL) AND {up}.cur IS NOT '{root or TOP}'",
        f"CASE WHEN s.id IS NOT NULL THEN {above} ELSE m.{parent} END",
    )


def in_target(run: SourceMerge, message: str) -> str:
    """SQL for the target's key of the source message ``message`` (NULL if the
    plan did not map it); on a thin source's chain past its own rows, the
    target's keys already."""
    mapped = f"(SELECT dst FROM temp.msg_map WHERE src = {message})"
    return f"coalesce({mapped}, {message})" if run.thin else mapped
