"""dagsync's own tables inside a database, all named ``_dagsync_*``.

They are created on first need, carry one row recording their layout version,
and are ignored by llm: a file without them is an ordinary llm database.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import apsw

LAYOUT_VERSION = "1"

DDL = """
CREATE TABLE IF NOT EXISTS _dagsync_meta (key TEXT PRIMARY KEY, value TEXT);
INSERT OR IGNORE INTO _dagsync_meta (key, value) VALUES ('layout_version', '1');
-- A merged message stored under another id in this file: a holder of the old
-- id (a user, a later merge) finds the surviving row here.
CREATE TABLE IF NOT EXISTS _dagsync_message_map (
    source_id TEXT PRIMARY KEY,
    target_id TEXT NOT NULL
);
-- A fork row a merge added for a diverged pointer, so a second merge of the
-- same source does not add it again.
CREATE TABLE IF NOT EXISTS _dagsync_forks (
    pointer_table TEXT NOT NULL,
    key TEXT NOT NULL,
    head TEXT NOT NULL,
    fork_key TEXT NOT NULL,
    PRIMARY KEY (pointer_table, key, head)
);
-- Where a row's head came from (merge.origins): the label of the file a
-- merge took it from, for the name of a fork that branch may later move to.
-- It holds only while the row still points at that head.
CREATE TABLE IF NOT EXISTS _dagsync_origins (
    pointer_table TEXT NOT NULL,
    key TEXT NOT NULL,
    head TEXT NOT NULL,
    label TEXT NOT NULL,
    PRIMARY KEY (pointer_table, key)
) WITHOUT ROWID;
-- When gc first found a row unreachable (a message with no time of its own)
-- or unreferenced (a shared row such as a fragment): gc deletes it only once
-- the grace period has passed since. A row reachable again is dropped from here.
-- How far this file has merged each source (merge.marks): the source's
-- identity, and, per table, the highest rowid merged and the key of the row
-- there; a later merge of it reads only what lies beyond (merge.delta).
CREATE TABLE IF NOT EXISTS _dagsync_sources (
    id INTEGER PRIMARY KEY,
    identity TEXT NOT NULL,  -- merge.marks.identity
    path TEXT, label TEXT, merged_at TEXT,
    rewritten TEXT  -- the file's own 'rewritten' stamp the marks were made under
);
CREATE INDEX IF NOT EXISTS _dagsync_sources_identity ON _dagsync_sources (identity);
CREATE TABLE IF NOT EXISTS _dagsync_marks (
    source INTEGER NOT NULL,
    tbl TEXT NOT NULL,
    mark INTEGER NOT NULL,
    mark_key TEXT,
    PRIMARY KEY (source, tbl)
) WITHOUT ROWID;
-- Each pointer row of a source (thread tip, conversation head) as last
-- merged: the one kind of row llm changes in place, which a mark cannot cover.
CREATE TABLE IF NOT EXISTS _dagsync_mark_pointers (
    source INTEGER NOT NULL,
    tbl TEXT NOT NULL,
    key TEXT NOT NULL,
    head TEXT,
    PRIMARY KEY (source, tbl, key)
) WITHOUT ROWID;
-- Per source and pointer table, the digest of those rows (merge.marks.pointer_digest,
-- kept up to date as they change), so that a bundle's digest is checked in the
-- time its own rows take (bundle.received). Signed: the digest less 2**63.
CREATE TABLE IF NOT EXISTS _dagsync_mark_digests (
    source INTEGER NOT NULL,
    tbl TEXT NOT NULL,
    rows INTEGER NOT NULL,
    digest INTEGER NOT NULL,
    PRIMARY KEY (source, tbl)
) WITHOUT ROWID;
-- Per source, its file's state when its marks and every pointer row were
-- taken (merge.marks.file_state: SQLite's change counter, inode, size, time):
-- while it is the same and no table grew, nothing was written to the file
-- since, and a merge of it has nothing to read (merge.marks.decide).
CREATE TABLE IF NOT EXISTS _dagsync_mark_files (
    source INTEGER PRIMARY KEY,
    state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS _dagsync_gc_seen (
    tbl TEXT NOT NULL,
    key TEXT NOT NULL,
    first_seen REAL NOT NULL,  -- unix time
    PRIMARY KEY (tbl, key)
);
-- A conversation `forget` deleted (dagsync/forget): a merge, sync, push or
-- pull does not bring it back while it is forgotten, that is while it was
-- not restored after it was forgotten. Merges take the latest of each time
-- from the files they read, so a forget (or a restore) travels with them.
CREATE TABLE IF NOT EXISTS _dagsync_forgotten (
    key TEXT PRIMARY KEY,  -- the conversation's id (a thread's, in the llm format)
    forgotten_at REAL NOT NULL,  -- unix time
    restored_at REAL  -- unix time, or NULL
) WITHOUT ROWID;
-- What a forget has unlinked and not yet collected: the messages its
-- conversations pointed at, and the shared rows they referenced. A forget
-- cut short leaves them here; the next one (or the merge that reapplies the
-- tombstones) finishes the job.
CREATE TABLE IF NOT EXISTS _dagsync_forget_pending (
    tbl TEXT NOT NULL,
    key NOT NULL,
    PRIMARY KEY (tbl, key)
) WITHOUT ROWID;
"""


def ensure(conn: apsw.Connection) -> None:
    """Create the bookkeeping tables if missing. Call inside a write transaction."""
    conn.execute(DDL)


def rewritten(conn: apsw.Connection, by: str) -> None:
    """Record that ``by`` (gc, canonicalise, unpack) deleted or rewrote rows of
    this file: marks made before no longer hold (merge.marks). Call inside the
    write transaction that does it. A file that holds no marks gets nothing."""
    if not has(conn, "_dagsync_sources") or not any(conn.execute("SELECT 1 FROM _dagsync_sources LIMIT 1")):
        return
    # To the microsecond: every rewrite gets a stamp of its own.
    now = time.time()
    stamp = f"{by} at {time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(now))}.{int(now % 1 * 1e6):06d}Z"
    previous = next(iter(conn.execute("SELECT value FROM _dagsync_meta WHERE key = 'rewritten'")), (None,))[0]
    if previous == stamp:
        stamp += "'"
    conn.execute("INSERT OR REPLACE INTO _dagsync_meta (key, value) VALUES ('rewritten', ?)", (stamp,))


def has(conn: apsw.Connection, table: str, schema: str = "main") -> bool:
    return any(conn.execute(f"SELECT 1 FROM {schema}.sqlite_schema WHERE type = 'table' AND name = ?", (table,)))


# A merge in progress: copied messages keep their own (old) created_at and stay
# unreachable until the merge's last steps point at them, and its plan maps
# rows onto the target's: gc must wait. The mark is a file beside the
# database (``<db>.dagsync-merging.<host>.<pid>``), not a row in it, so that a
# merge with nothing to do still writes nothing to the database.
MERGING = ".dagsync-merging."
# A mark from another host counts as live for this long.
MERGE_MARK_HOURS = 24


@contextlib.contextmanager
def merging(path: str | os.PathLike[str]) -> Iterator[None]:
    """Mark ``path`` as being merged into for the duration of the block (gc waits)."""
    mark = Path(f"{path}{MERGING}{socket.gethostname()}.{os.getpid()}")
    fd = os.open(mark, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    os.close(fd)
    try:
        yield
    finally:
        mark.unlink(missing_ok=True)


def merge_running(path: str | os.PathLike[str]) -> bool:
    """Whether a merge into ``path`` is under way (a mark whose process still runs)."""
    base = Path(path)
    host = socket.gethostname()
    for mark in base.parent.glob(base.name + MERGING + "*"):
        marker_host, _, pid = mark.name[len(base.name + MERGING) :].rpartition(".")
        if marker_host != host:
            try:
                if time.time() - mark.stat().st_mtime < MERGE_MARK_HOURS * 3600:
                    return True
            except FileNotFoundError:
                pass
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            continue  # a merge that was killed: its mark is stale
        except (PermissionError, ValueError):
            return True
        return True
    return False
