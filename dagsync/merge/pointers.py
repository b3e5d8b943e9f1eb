"""Mutable pointers: conversation heads (dag) and thread tips (llm).

The one kind of value llm changes in place. When a row is on both sides and
its pointer differs, the merge decides, into ``temp.ptr``:

* FAST_FORWARD - the target's head is on the source head's chain: move it on;
* KEEP - the source's head is on the target head's chain (the target is
  ahead), or is a head the target already has;
* FORK - the heads diverged: the target keeps its head, and gains a copy of
  the source's row under a new key, pointing at the source's head, named
  ``<name> (branch from <source label>)``, recorded in ``_dagsync_forks``
  (``core.source_label``: the file's stem, or the llm home it is in).

A source head is never dropped. The candidates in the target are the row
itself and the fork rows earlier merges added for it, so the same
divergence merged again, or from another order of files, lands on exactly
the chains it would have had.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ulid import ULID

from dagsync import bookkeeping
from dagsync.formats import Table
from dagsync.merge.core import SourceMerge, quoted
from dagsync.merge.maps import expr
from dagsync.merge.messages import NEW
from dagsync.merge.report import ForkReport

__all__ = ["apply", "plan"]

# Verdicts in temp.ptr.
FAST_FORWARD, KEEP, FORK = 1, 2, 3


def plan(run: SourceMerge, table: Table) -> None:
    """Decide each pointer both sides have but set differently.

    If the source's head is on a candidate's chain, the target already has
    it: keep. If a candidate's head is on the source head's chain, that
    candidate fast-forwards (the row itself first). Otherwise: fork.
    """
    c = run.conn
    name, pointer = table.name, table.pointer
    key = table.natural_key[0]
    head = expr(run, table, pointer, written=True)  # NULL for a head the plan did not see: ignored
    c.execute(
        "CREATE TEMP TABLE ptr (key TEXT PRIMARY KEY, s_raw TEXT, s_head TEXT, t_head TEXT, "
        "verdict INTEGER, row TEXT, row_head TEXT)"
    )
    for low, high in run.chunks(f'src."{name}"'):
        c.execute(
            f'INSERT INTO temp.ptr (key, s_raw, s_head, t_head) SELECT s."{key}", s."{pointer}", {head}, '
            f't."{pointer}" FROM src."{name}" s JOIN main."{name}" t ON t."{key}" = s."{key}" '
            f"WHERE s.rowid BETWEEN ? AND ? AND {head} IS NOT NULL AND {head} IS NOT t.\"{pointer}\"",
            (low, high),
        )
    c.execute("UPDATE temp.ptr SET verdict = ?, row = key WHERE t_head IS NULL", (FAST_FORWARD,))
    _candidates(run, table)
    # The source's head is a candidate's own head (a re-merge, or the same
    # divergence merged before): the target has it, no chains to walk.
    c.execute(
        "UPDATE temp.ptr SET verdict = ? WHERE verdict IS NULL AND EXISTS "
        "(SELECT 1 FROM temp.cand c WHERE c.key = ptr.key AND c.head = ptr.s_head)",
        (KEEP,),
    )
    _walk_chains(run)
    c.execute(
        "UPDATE temp.ptr SET verdict = ?, (row, row_head) = (SELECT c.row, c.head FROM temp.cand c "
        "JOIN temp.s_up u ON u.key = c.key AND u.dst = c.head WHERE c.key = ptr.key "
        "ORDER BY c.row != ptr.key, c.row LIMIT 1) "
        "WHERE verdict IS NULL AND EXISTS (SELECT 1 FROM temp.cand c JOIN temp.s_up u "
        "ON u.key = c.key AND u.dst = c.head WHERE c.key = ptr.key)",
        (FAST_FORWARD,),
    )
    c.execute("UPDATE temp.ptr SET verdict = ? WHERE verdict IS NULL", (FORK,))
    counts = run.counts[name]
    counts.updated = run.one("SELECT count(*) FROM temp.ptr WHERE verdict = ?", (FAST_FORWARD,))
    counts.forked = run.one("SELECT count(*) FROM temp.ptr WHERE verdict = ?", (FORK,))
    # The forks the apply will add, for the report (a dry run's too).
    named = '"name"' if "name" in run.columns[name] else "NULL"
    for original, s_head, fork_name in c.execute(
        f'SELECT p.key, p.s_head, s.{named} FROM temp.ptr p JOIN src."{name}" s ON s."{key}" = p.key '
        "WHERE p.verdict = ?",
        (FORK,),
    ).fetchall():
        fork_name = None if named == "NULL" else f"{fork_name or 'conversation'}{_suffix(run)}"
        run.forks.append(ForkReport(name, original, _fork_key(run, name, key, original, s_head), fork_name, s_head, "source"))


def _suffix(run: SourceMerge) -> str:
    return f" (branch from {run.label})"


def _candidates(run: SourceMerge, table: Table) -> None:
    """``temp.cand``: for each undecided row, the row itself and its earlier forks, with their heads."""
    c = run.conn
    c.execute("CREATE TEMP TABLE cand (key TEXT NOT NULL, row TEXT NOT NULL, head TEXT)")
    c.execute("INSERT INTO temp.cand SELECT key, key, t_head FROM temp.ptr WHERE verdict IS NULL")
    if bookkeeping.has(c, "_dagsync_forks"):
        c.execute(
            f'INSERT INTO temp.cand SELECT p.key, f.fork_key, t."{table.pointer}" FROM temp.ptr p '
            f"JOIN main._dagsync_forks f ON f.pointer_table = ? AND f.key = p.key "
            f'JOIN main."{table.name}" t ON t."{table.natural_key[0]}" = f.fork_key WHERE p.verdict IS NULL',
            (table.name,),
        )
    c.execute("CREATE INDEX temp.cand_key ON cand (key, head)")


def _walk_chains(run: SourceMerge) -> None:
    """Keep what a candidate's chain holds; then ``temp.s_up``: the source heads'
    chains, in the target's ids, for the fast-forwards to be found in."""
    c = run.conn
    mkey, parent, root = run.fmt.message_key, run.fmt.parent_column, run.fmt.root_id
    not_root = f"m.{mkey} != '{root}'" if root else "1"
    c.execute("CREATE TEMP TABLE s_up (key TEXT NOT NULL, dst TEXT)")
    c.execute("CREATE TEMP TABLE t_up (key TEXT NOT NULL, cur TEXT)")
    for low, high in run.chunks("temp.ptr"):
        # Every message on each candidate's chain, up to the source's head
        # (finding it is all the chain is asked for). A head the target
        # lacks is on none of its chains: no walk.
        c.execute(
            f"INSERT INTO temp.t_up WITH RECURSIVE up(k, cur, stop) AS (SELECT c.key, c.head, p.s_head "
            f"FROM temp.cand c JOIN temp.ptr p ON p.key = c.key WHERE p.verdict IS NULL "
            f"AND p.rowid BETWEEN ? AND ? AND (SELECT kind FROM temp.msg_map WHERE src = p.s_raw) IS NOT {NEW} "
            f"UNION SELECT up.k, m.{parent}, up.stop FROM up JOIN main.messages m ON m.{mkey} = up.cur "
            f"WHERE {not_root} AND up.cur IS NOT up.stop) SELECT k, cur FROM up",
            (low, high),
        )
    c.execute("CREATE INDEX temp.t_up_key ON t_up (key, cur)")
    c.execute(
        "UPDATE temp.ptr SET verdict = ? WHERE verdict IS NULL AND EXISTS "
        "(SELECT 1 FROM temp.t_up u WHERE u.key = ptr.key AND u.cur = ptr.s_head)",
        (KEEP,),
    )
    for low, high in run.chunks("temp.ptr"):
        # What is left (not kept): every message on the source head's
        # chain, in the target's ids, up to the row's own head: past it,
        # nothing can change the verdict (the row itself is the
        # fast-forward preferred).
        c.execute(
            f"INSERT INTO temp.s_up WITH RECURSIVE up(k, cur, stop) AS (SELECT key, s_raw, t_head "
            f"FROM temp.ptr WHERE verdict IS NULL AND rowid BETWEEN ? AND ? "
            f"UNION SELECT up.k, m.{parent}, up.stop FROM up JOIN src.messages m ON m.{mkey} = up.cur "
            f"WHERE {not_root} AND (SELECT dst FROM temp.msg_map WHERE src = up.cur) IS NOT up.stop) "
            "SELECT up.k, mm.dst FROM up JOIN temp.msg_map mm ON mm.src = up.cur",
            (low, high),
        )
    c.execute("CREATE INDEX temp.s_up_key ON s_up (key, dst)")


def apply(run: SourceMerge, table: Table) -> None:
    """Move the pointers to fast-forward, then add a fork row for each that diverged."""
    planned = run.counts[table.name]
    if not (planned.updated or planned.forked):
        return
    c = run.conn
    name, pointer = table.name, table.pointer
    key = table.natural_key[0]
    with run.writer.transaction():
        # Only where the row still points where the plan saw it.
        c.execute(
            f'UPDATE main."{name}" SET "{pointer}" = p.s_head FROM temp.ptr p '
            f'WHERE p.verdict = ? AND main."{name}"."{key}" = p.row '
            f'AND main."{name}"."{pointer}" IS p.row_head',
            (FAST_FORWARD,),
        )
        run.written[name].updated += run.changes()
        # A live writer moved a pointer we meant to fast-forward: the
        # source's head is kept as a fork instead of being dropped.
        c.execute(
            f'UPDATE temp.ptr SET verdict = ? WHERE verdict = ? AND NOT EXISTS (SELECT 1 FROM main."{name}" t '
            f'WHERE t."{key}" = ptr.row AND t."{pointer}" IS ptr.s_head)',
            (FORK, FAST_FORWARD),
        )
    forks = list(c.execute("SELECT key, s_head FROM temp.ptr WHERE verdict = ?", (FORK,)))
    if not forks:
        return
    suffix = _suffix(run)
    run.forks = [f for f in run.forks if f.table != name]  # what is written replaces what was planned
    with run.writer.transaction():
        bookkeeping.ensure(c)
        for original, s_head in forks:
            fork_key = _fork_key(run, name, key, original, s_head)
            # A copy of the source's row under a new key, pointing where the
            # source pointed, named so a person can see where it came from
            # (and, in the llm format, saying which thread it forked from).
            values: dict[str, tuple[str, tuple[Any, ...]]] = {col: (f's."{col}"', ()) for col in run.columns[name]}
            values[key] = ("?", (fork_key,))
            values[pointer] = ("?", (s_head,))
            if "name" in values:
                values["name"] = ("coalesce(s.\"name\", 'conversation') || ?", (suffix,))
            if "forked_from" in values:
                values["forked_from"] = ("?", (original,))
            exprs = ", ".join(sql for sql, _ in values.values())
            params = [p for _, ps in values.values() for p in ps]
            c.execute(
                f'INSERT INTO main."{name}" ({quoted(list(values))}) SELECT {exprs} '
                f'FROM src."{name}" s WHERE s."{key}" = ?',
                (*params, original),
            )
            if not run.changes():
                continue  # the source row is gone; nothing to record
            c.execute(
                "INSERT INTO main._dagsync_forks (pointer_table, key, head, fork_key) VALUES (?, ?, ?, ?)",
                (name, original, s_head, fork_key),
            )
            run.written[name].forked += 1
            fork_name = run.one(f'SELECT "name" FROM main."{name}" WHERE "{key}" = ?', (fork_key,)) if "name" in values else None
            run.forks.append(ForkReport(name, original, fork_key, fork_name, s_head, "source"))


def _fork_key(run: SourceMerge, table: str, key: str, original: str, head: str) -> str:
    """A key for the fork of row ``original`` that sorts just before it.

    llm continues (``llm -c``) the thread or conversation with the highest
    id; a fork row has no turns of its own, so it must never be the newest.
    A ULID one millisecond older than the original's, its random part taken
    from (original, head), does that, and is the same in every merge of the
    same divergence. Anything else gets a new ULID.
    """
    try:
        ms = ULID.from_str(original.upper()).milliseconds
    except (ValueError, TypeError):
        return run.new_id()
    # Everything the fork row is made of: the same divergence merged from
    # another file (another name in the row) is another fork.
    digest = hashlib.sha256(f"{original}\0{head}\0{run.label}".encode()).digest()[:10]
    candidate = str(ULID.from_bytes(max(ms - 1, 0).to_bytes(6, "big") + digest)).lower()
    if run.one(f'SELECT 1 FROM main."{table}" WHERE "{key}" = ?', (candidate,)):
        return run.new_id()
    return candidate
