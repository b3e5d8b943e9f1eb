"""Mutable pointers: conversation heads (dag) and thread tips (llm).

The one kind of value llm changes in place. When a row is on both sides and
its pointer differs, the merge decides, into ``temp.ptr``:

* FAST_FORWARD - the target's head (or one of its forks') is on the source
  head's chain: move it on;
* KEEP - the source's head is on the target head's chain (the target is
  ahead), or is a head the target or one of its forks already has;
* FORK - the heads diverged and the target's branch is the newer: the
  target keeps its head, and gains a copy of the source's row under the
  branch's fork key, pointing at the source's head;
* SWAP (``branches``) - they diverged and the source's branch is the newer:
  the row moves to the source's head, and a copy of the target's row, under
  its branch's fork key, keeps the target's head.

A fork row is named ``<name> (branch from <label>)``, after the file the
branch came from (``core.source_label``, or merge's ``--label``), keyed by
where the branch begins (``_fork_key``, ``branches.starts``), and recorded in
``_dagsync_forks``. The
calls of a forked conversation follow their branch (``branches``). A head is
never dropped. The candidates in the target are the row itself and its
forks (recorded, or, in the llm format, any thread ``forked_from`` it), so
the same divergence merged again, or from another order of files, lands on
exactly the chains it would have had.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import apsw
from ulid import ULID

from dagsync import bookkeeping
from dagsync.formats import Table
from dagsync.merge import branches, origins
from dagsync.merge.branches import SWAP
from dagsync.merge.core import SourceMerge, quoted
from dagsync.merge.maps import expr
from dagsync.merge.chains import in_target, step_up
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
    branches.families(run, table)
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
    branches.choose(run, table, FORK, FAST_FORWARD)
    counts = run.counts[name]
    # A swap moves the row on to the source's head, and adds a fork: both.
    counts.updated = run.one("SELECT count(*) FROM temp.ptr WHERE verdict IN (?, ?)", (FAST_FORWARD, SWAP))
    counts.forked = run.one("SELECT count(*) FROM temp.ptr WHERE verdict IN (?, ?)", (FORK, SWAP))
    # The forks the apply will add (for the report, a dry run's too), and
    # where every call of their conversations belongs.
    c.execute("ALTER TABLE temp.ptr ADD COLUMN fork TEXT")
    c.execute("ALTER TABLE temp.ptr ADD COLUMN label TEXT")
    named = '"name"' if "name" in run.columns[name] else "NULL"
    # Where each branch came from: the file holding it, unless a merge brought it there.
    s_origin = origins.label_sql(run, "src", table, "p.key", "p.s_raw")
    t_origin = origins.label_sql(run, "main", table, "p.key", "p.t_head")
    starts = branches.starts(run, table, FORK)
    rows = c.execute(
        f"SELECT p.key, p.verdict, p.s_head, p.t_head, s.{named}, t.{named}, {s_origin}, {t_origin} "
        f'FROM temp.ptr p JOIN src."{name}" s ON s."{key}" = p.key JOIN main."{name}" t ON t."{key}" = p.key '
        "WHERE p.verdict IN (?, ?)",
        (FORK, SWAP),
    ).fetchall()
    wanted = []
    for original, verdict, s_head, t_head, *_ in rows:
        head = s_head if verdict == FORK else t_head
        wanted.append((original, _fork_key(original, starts.get(original) or head), head, verdict == FORK))
    found = branches.taken(run, table, wanted)
    planned = []
    for (original, verdict, s_head, t_head, s_name, t_name, s_label, t_label), (_, fork_key, head, _) in zip(rows, wanted):
        if verdict == FORK:
            side, label = "source", s_label or run.label
        else:
            side, label = "target", t_label or run.target_label
        held, row_name = found[original]
        if held == "other":
            # Another branch that begins where this one does already has that row
            # (the two parted later): this one is keyed by its tip.
            fork_key, held = _fork_key(original, head), "free"
        fork_name = None if named == "NULL" else _fork_name(s_name if verdict == FORK else t_name, label)
        if held != "free" and fork_name is not None:
            # The branch's row is there already (this file's, or arriving from the source): its name stays.
            fork_name = row_name or fork_name
        run.forks.append(ForkReport(name, original, fork_key, fork_name, head, side))
        planned.append((original, fork_key, head, verdict, label, held))
    c.execute(
        "UPDATE temp.ptr SET (fork, label) = (j.value ->> 1, j.value ->> 2) FROM json_each(?) j WHERE ptr.key = j.value ->> 0",
        (json.dumps([[k, f, lb] for k, f, _, _, lb, _ in planned]),),
    )
    raw_heads = dict(c.execute("SELECT key, s_raw FROM temp.ptr WHERE verdict = ?", (FORK,)).fetchall())
    branches.plan(
        run, table,
        [(k, f, raw_heads[k] if v == FORK else h, v == FORK, held != "ahead") for k, f, h, v, _, held in planned],
        FAST_FORWARD,
        f"verdict IN ({FORK}, {SWAP}) OR (verdict = {FAST_FORWARD} AND row != key)",
    )  # fmt: skip


def _fork_name(name: str | None, label: str) -> str:
    """``<name> (branch from <label>)``; a fork of a fork says only where its own branch came from."""
    return f"{_FORK_SUFFIX.sub('', name or '') or 'conversation'} (branch from {label})"


_FORK_SUFFIX = re.compile(r" \(branch from [^()]*\)$")


def _candidates(run: SourceMerge, table: Table) -> None:
    """``temp.cand``: for each undecided row, the row itself and its earlier forks, with their heads."""
    c = run.conn
    c.execute("CREATE TEMP TABLE cand (key TEXT NOT NULL, row TEXT NOT NULL, head TEXT)")
    c.execute("CREATE INDEX temp.cand_row ON cand (key, row)")  # a row's candidates, looked up by key
    c.execute("INSERT INTO temp.cand SELECT key, key, t_head FROM temp.ptr WHERE verdict IS NULL")
    if bookkeeping.has(c, "_dagsync_forks"):
        c.execute(
            f'INSERT INTO temp.cand SELECT p.key, f.fork_key, t."{table.pointer}" FROM temp.ptr p '
            f"JOIN main._dagsync_forks f ON f.pointer_table = ? AND f.key = p.key "
            f'JOIN main."{table.name}" t ON t."{table.natural_key[0]}" = f.fork_key WHERE p.verdict IS NULL',
            (table.name,),
        )
    if "forked_from" in run.columns[table.name]:
        # llm says which thread a thread forked from: a fork another file's merge added counts too.
        # One pass over the table (forked_from has no index), each fork looked up in temp.ptr by key.
        c.execute(
            f'INSERT INTO temp.cand SELECT p.key, t."{table.natural_key[0]}", t."{table.pointer}" '
            f'FROM main."{table.name}" t CROSS JOIN temp.ptr p ON p.key = t."forked_from" '
            "WHERE t.\"forked_from\" IS NOT NULL AND p.verdict IS NULL "
            "AND NOT EXISTS (SELECT 1 FROM temp.cand c WHERE c.key = p.key AND c.row = t."
            f'"{table.natural_key[0]}")'
        )
    # A fork whose head is on the row's own chain (llm's own fork of an
    # earlier turn, with no branch of its own yet) is no branch to move on:
    # the source's row continuing past that point continues the row itself.
    mkey, parent, root = run.fmt.message_key, run.fmt.parent_column, run.fmt.root_id
    not_root = f"m.{mkey} != '{root}'" if root else "1"
    c.execute(
        "WITH RECURSIVE own(key, cur) AS (SELECT key, head FROM temp.cand WHERE row = key "
        "AND key IN (SELECT key FROM temp.cand WHERE row != key) "
        f"UNION SELECT own.key, m.{parent} FROM own JOIN main.messages m ON m.{mkey} = own.cur WHERE {not_root}) "
        "DELETE FROM temp.cand WHERE row != key AND head IN (SELECT cur FROM own WHERE own.key = cand.key)"
    )
    c.execute("CREATE INDEX temp.cand_key ON cand (key, head)")


def _walk_chains(run: SourceMerge) -> None:
    """Keep what a candidate's chain holds; then ``temp.s_up``: the source heads'
    chains, in the target's ids, for the fast-forwards to be found in."""
    c = run.conn
    mkey, parent, root = run.fmt.message_key, run.fmt.parent_column, run.fmt.root_id
    not_root = f"m.{mkey} != '{root}'" if root else "1"
    c.execute("CREATE TEMP TABLE s_up (key TEXT NOT NULL, dst TEXT)")
    c.execute("CREATE TEMP TABLE t_up (key TEXT NOT NULL, row TEXT NOT NULL, cur TEXT)")
    for low, high in run.chunks("temp.ptr"):
        # Every message on each candidate's chain, up to the source's head
        # (finding it is all the chain is asked for). A head the target
        # lacks is on none of its chains: no walk.
        c.execute(
            f"INSERT INTO temp.t_up WITH RECURSIVE up(k, row, cur, stop) AS (SELECT c.key, c.row, c.head, p.s_head "
            f"FROM temp.cand c JOIN temp.ptr p ON p.key = c.key WHERE p.verdict IS NULL "
            f"AND p.rowid BETWEEN ? AND ? AND (SELECT kind FROM temp.msg_map WHERE src = p.s_raw) IS NOT {NEW} "
            f"UNION SELECT up.k, up.row, m.{parent}, up.stop FROM up JOIN main.messages m ON m.{mkey} = up.cur "
            f"WHERE {not_root} AND up.cur IS NOT up.stop) SELECT k, row, cur FROM up",
            (low, high),
        )
    c.execute("CREATE INDEX temp.t_up_key ON t_up (key, cur)")

    c.execute(
        "UPDATE temp.ptr SET verdict = ? WHERE verdict IS NULL AND EXISTS "
        "(SELECT 1 FROM temp.t_up u WHERE u.key = ptr.key AND u.cur = ptr.s_head)",
        (KEEP,),
    )
    follow, above = step_up(run)
    here = in_target(run, "up.cur")
    for low, high in run.chunks("temp.ptr"):
        # What is left (not kept): every message on the source head's
        # chain, in the target's ids, up to the row's own head: past it,
        # nothing can change the verdict (the row itself is the
        # fast-forward preferred).
        c.execute(
            f"INSERT INTO temp.s_up WITH RECURSIVE up(k, cur, stop) AS (SELECT key, s_raw, t_head "
            f"FROM temp.ptr WHERE verdict IS NULL AND rowid BETWEEN ? AND ? "
            f"UNION SELECT up.k, {above}, up.stop FROM up {follow} AND {here} IS NOT up.stop) "
            f"SELECT k, dst FROM (SELECT up.k, {here} AS dst FROM up) WHERE dst IS NOT NULL",
            (low, high),
        )
    c.execute("CREATE INDEX temp.s_up_key ON s_up (key, dst)")


def apply(run: SourceMerge, table: Table) -> None:
    """Move the pointers to fast-forward, then add a fork row for each that diverged."""
    planned = run.counts[table.name]
    if not (planned.updated or planned.forked or run.branches):
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
        if run.written[name].updated:
            origins.record_moved(run, table, FAST_FORWARD)
    forks = list(
        c.execute("SELECT key, verdict, s_head, t_head, fork, label FROM temp.ptr WHERE verdict IN (?, ?)", (FORK, SWAP))
    )
    if not forks and not run.branches:
        return
    with run.writer.transaction():
        bookkeeping.ensure(c)
        for original, verdict, s_head, t_head, fork_key, label in forks:
            fork_key = fork_key or _fork_key(original, s_head)  # a fast-forward a live writer turned into a fork
            if verdict == SWAP:
                # The source's branch is the newer: the row moves to it (only
                # if it still points where the plan saw it), and the target's
                # branch goes to the fork.
                c.execute(
                    f'UPDATE main."{name}" SET "{pointer}" = ? WHERE "{key}" = ? AND "{pointer}" IS ?',
                    (s_head, original, t_head),
                )
                if not run.changes():
                    # A live writer continued the target's branch meanwhile: plan again.
                    raise apsw.ConstraintError(f"{name} {original} moved while the merge was writing")
                run.written[name].updated += 1
                _add_fork(run, table, "main", original, fork_key, t_head, label or run.target_label)
            else:
                _add_fork(run, table, "src", original, fork_key, s_head, label or run.label)
        origins.record_moved(run, table, SWAP, row="key")
        run.written[run.fmt.call_table].moved += branches.apply(run)


def _add_fork(run: SourceMerge, table: Table, schema: str, original: str, fork_key: str, head: str, label: str) -> None:
    """A copy of ``schema``'s row ``original`` under ``fork_key``, pointing at
    ``head``, named after the branch's ``label`` (and, in the llm format,
    saying which thread it forked from); recorded in ``_dagsync_forks``."""
    c = run.conn
    name, pointer, key = table.name, table.pointer, table.natural_key[0]
    values: dict[str, tuple[str, tuple[Any, ...]]] = {col: (f's."{col}"', ()) for col in run.columns[name]}
    values[key] = ("?", (fork_key,))
    values[pointer] = ("?", (head,))
    if "name" in values:
        named = run.one(f'SELECT "name" FROM {schema}."{name}" WHERE "{key}" = ?', (original,))
        values["name"] = ("?", (_fork_name(named, label),))
    if "forked_from" in values:
        values["forked_from"] = ("?", (original,))
    exprs = ", ".join(sql for sql, _ in values.values())
    params = [p for _, ps in values.values() for p in ps]
    # OR IGNORE: the same fork may arrive as a row of the source (a file this one synced with).
    c.execute(
        f'INSERT OR IGNORE INTO main."{name}" ({quoted(list(values))}) SELECT {exprs} '
        f'FROM {schema}."{name}" s WHERE s."{key}" = ?',
        (*params, original),
    )
    if run.changes():
        run.written[name].forked += 1
    elif bookkeeping.has(c, "schain", "temp"):
        # The branch's row is there (copied from the source, or made by an
        # earlier merge) at an earlier tip of the same branch: it moves on.
        c.execute(
            f'UPDATE main."{name}" SET "{pointer}" = ? WHERE "{key}" = ? AND "{pointer}" IS NOT ? '
            f'AND "{pointer}" IN (SELECT msg FROM temp.{"schain" if schema == "src" else "tchain"} WHERE key = ?)',
            (head, fork_key, head, original),
        )
        run.written[name].updated += run.changes()
    c.execute(
        "INSERT OR IGNORE INTO main._dagsync_forks (pointer_table, key, head, fork_key) VALUES (?, ?, ?, ?)",
        (name, original, head, fork_key),
    )
    origins.record(run, table, fork_key, head, label)


def _fork_key(original: str, head: str) -> str:
    """The key of the fork of row ``original`` holding the branch that begins
    at message ``head`` (``branches.starts``; its tip where that key is taken):
    the same in every file and every merge of that branch, whichever tip the
    branch had when it was forked.

    llm continues (``llm -c``) the thread or conversation with the highest
    id, so a fork sorts just before its original: a ULID one millisecond
    older, its random part taken from (original, head). A key that is not a
    ULID gets one made from the same digest.
    """
    digest = hashlib.sha256(f"{original}\0{head}".encode()).digest()
    try:
        ms = ULID.from_str(original.upper()).milliseconds
    except (ValueError, TypeError):
        return str(ULID.from_bytes(digest[:16])).lower()
    return str(ULID.from_bytes(max(ms - 1, 0).to_bytes(6, "big") + digest[:10])).lower()
