"""Marks: how far a target has merged each source, so that the next merge of
it reads only what is new (``delta``).

After a merge the target records, for the source (``_dagsync_sources``):

* its **identity**: the format and the first migration llm (or dagsync)
  recorded in it, with the time it was applied - the same after a rename or
  a move, and another for a file made at another time;
* per table, the **mark**: the highest rowid merged, and the key of the row
  there (``_dagsync_marks``);
* each **pointer row** (thread tip, conversation head) as merged
  (``_dagsync_mark_pointers``): the one kind of row llm changes in place.

A later merge of a file with that identity first proves the marks hold: the
row at each mark is still there under the same key (rows below a mark were
not deleted and renumbered, by a VACUUM, a gc or ``llm logs rm``; the file
was not replaced by an earlier copy of itself), and the target was not
rewritten since (gc, canonicalise and unpack stamp it: ``bookkeeping.rewritten``).
Then every row at or below the marks is already in the target, and the merge
reads only the rows beyond them and the pointer rows that changed.
Otherwise it merges in full, and says why. A forget in the target leaves the
marks holding, with a gap: rows of the conversations it keeps tombstones for
(``forgotten_below``).

Finding the pointer rows that changed reads every one of them (llm's 58k
threads: 70 ms, most of a re-merge with nothing new). So the target also
keeps the source file's **state** (``_dagsync_mark_files``, ``file_state``):
the change counter SQLite adds one to in the file's header with every
transaction it commits in rollback-journal mode (llm's), with the file's
inode, size and modification time. When the marks were taken with every
pointer row, and the state and every table's highest row are the same now,
nothing was written to the file since, and the merge reads nothing more
(``Decision.unchanged``). A file in WAL mode, or with a ``-wal`` file
beside it, has no such counter to trust.

Two files with one identity (a copy of logs.db that went on on another
machine) each have an entry of their own, by path (``host:path`` for one
that arrived as a bundle): an entry is used for the file at its path, or
for a file of its identity elsewhere only once nothing is left at that path
(the file moved), and then only if its marks hold.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import apsw

from dagsync import bookkeeping
from dagsync.errors import UnresolvedReference
from dagsync.forget import tombstones
from dagsync.formats import Format, Key

__all__ = [
    "Decision", "Marks", "decide", "disproof", "file_state", "forgotten_below", "identity", "key_sql", "marked_tables", "moved_from",
    "pointer_digest", "pointer_digest_of", "row_hash", "save", "stored_digest", "taken", "where",
]  # fmt: skip

# dagsync's own tables a merge reads from a source, append-only: marked too.
MARKED_BOOKKEEPING = {
    "_dagsync_forks": ("pointer_table", "key", "head"),
    "_dagsync_message_map": ("source_id",),
}


@dataclass(frozen=True)
class Marks:
    """One entry of ``_dagsync_sources`` and its marks: table -> (rowid, key there)."""

    entry: int
    path: str
    tables: dict[str, tuple[int, str | None]]
    # The file's state when they and every pointer row were taken (file_state), if known.
    state: str | None = None


@dataclass(frozen=True)
class Decision:
    """How a source is merged: from its marks (``marks``), or in full and why."""

    identity: str | None
    marks: Marks | None = None
    why_full: str | None = None  # None when incremental
    # The entry a full merge records its marks in (the file at this path before), if any.
    entry: int | None = None
    # A bundle's record (bundle.Received): the source is the bundle, thin.
    bundle: object | None = None
    # The source's tables, when nothing was written to it since its marks were
    # taken (its file's state and every table's highest row are the same): nothing to read.
    unchanged: frozenset[str] | None = None

    @property
    def incremental(self) -> bool:
        return self.marks is not None and self.bundle is None


def key_sql(fmt: Format, table: str) -> str:
    """SQL for the key of a row of ``table``, as one text value (the mark's key)."""
    columns: tuple[str, ...]
    if table in MARKED_BOOKKEEPING:
        columns = MARKED_BOOKKEEPING[table]
    else:
        t = fmt.table(table)
        columns = (fmt.message_key,) if t.key in (Key.DAG_MESSAGE, Key.HASH_MESSAGE) else t.natural_key
    return " || ',' || ".join(f'quote("{c}")' for c in columns) or "rowid"


def forgotten_below(conn: apsw.Connection, decision: Decision, exc: UnresolvedReference) -> str | None:
    """Why a source read from its marks must be read whole after ``exc``, or None.

    The marks say that every row of the source at or below them is in the
    target (``main`` on ``conn``) - or was removed by a forget there: the rows
    of the conversations it forgot, and what only they reached. A new row may
    refer to one of those (a forgotten thread continued on the source, a fork
    of its prefix); only the whole source has it again, and a full merge,
    which forgets again what the tombstones name, ends as it must. A target
    that never forgot has no such gap: a reference that resolves nowhere is
    the source's fault.
    """
    thin = decision.incremental or (decision.bundle is not None and getattr(decision.bundle, "entry", None) is not None)
    if not thin or not tombstones.kept(conn):
        return None
    return f"a row beyond the marks refers to what a forget removed from the target ({exc.detail})"


def marked_tables(fmt: Format, present: set[str]) -> list[str]:
    """The tables of a source that carry marks: every table a merge copies, and
    dagsync's own append-only records."""
    names = [t.name for t in fmt.merge_order if t.name in present]
    return names + [n for n in MARKED_BOOKKEEPING if n in present]


def taken(conn: apsw.Connection, fmt: Format, schema: str, present: set[str]) -> dict[str, tuple[int, str | None]]:
    """Each marked table's highest rowid in ``schema`` now and the key of the row
    there. Call inside the read transaction the merge reads the source in."""
    marks = {}
    for name in marked_tables(fmt, present):
        high = next(iter(conn.execute(f'SELECT coalesce(max(rowid), 0) FROM {schema}."{name}"')))[0]
        key = None
        if high:
            key = next(iter(conn.execute(f'SELECT {key_sql(fmt, name)} FROM {schema}."{name}" WHERE rowid = ?', (high,))))[0]
        marks[name] = (high, key)
    return marks


def file_state(path: str | Path) -> str | None:
    """What says whether the SQLite file at ``path`` was written since: the
    change counter in its header, with its inode, size and modification
    time; or None where that cannot be told.

    SQLite adds one to the counter with every transaction it commits in
    rollback-journal mode; the inode and time tell another file put in its
    place whose counter happens to match. Read it while holding the file's
    SHARED lock (inside a read transaction, after a read): then no commit is
    half-written. None for a file in WAL mode (header bytes 18-19 are 2, or
    a ``-wal`` file is beside it), whose commits leave the counter alone, and
    for a header whose counter is not the one SQLite last wrote there
    (offset 92 differs: an old SQLite, or another program, wrote it).
    """
    try:
        with open(path, "rb") as f:
            header = f.read(100)
            st = os.fstat(f.fileno())
        if Path(f"{path}-wal").exists():
            return None
    except OSError:
        return None
    if len(header) < 100 or header[18] != 1 or header[19] != 1 or header[24:28] != header[92:96]:
        return None
    return f"{int.from_bytes(header[24:28], 'big')}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def identity(conn: apsw.Connection, fmt: Format, schema: str = "src") -> str:
    """What a source is, wherever it lies: its format, and the first migration
    recorded in it with when it was applied (llm records it once, when it
    first opens a new file; dagsync, when it creates one)."""
    first: tuple = ()
    if bookkeeping.has(conn, "_llm_migrations", schema):
        columns = {row[1] for row in conn.execute(f"PRAGMA {schema}.table_info(_llm_migrations)")}
        when = "applied_at" if "applied_at" in columns else "NULL"
        for row in conn.execute(f"SELECT name, {when} FROM {schema}._llm_migrations ORDER BY {when}, name LIMIT 1"):
            first = tuple(row)
    return hashlib.sha256(repr((fmt.name, first)).encode()).hexdigest()[:32]


def decide(conn: apsw.Connection, fmt: Format, source: Path, present: set[str]) -> Decision:
    """Whether the source attached as ``src`` can be merged from its marks in the target.

    Entries of its identity are tried, the one recorded at this path first; the
    first whose marks hold is used.
    """
    ident = identity(conn, fmt)
    if not bookkeeping.has(conn, "_dagsync_sources"):
        return Decision(ident, why_full="first merge of this source")
    path = where(source)
    entries = list(conn.execute(
        "SELECT id, path, rewritten FROM main._dagsync_sources WHERE identity = ? ORDER BY path IS NOT ?, id",
        (ident, path),
    ))  # fmt: skip
    same_path = next((entry for entry, at, _ in entries if at == path), None)
    if not entries:
        return Decision(ident, why_full="first merge of this source")
    rewritten = _rewritten(conn)
    reasons = []
    for entry, at, stamp in entries:
        if at != path and not moved_from(at):
            # Another file of this identity (a copy that went on elsewhere): its marks
            # say nothing of what this one holds below them.
            continue
        if stamp != rewritten:
            reasons.append(f"the target was changed since ({rewritten}): rows merged before may be gone")
            continue
        marks = dict(
            ((tbl, (mark, key)) for tbl, mark, key in conn.execute(
                "SELECT tbl, mark, mark_key FROM main._dagsync_marks WHERE source = ?", (entry,)
            ))
        )  # fmt: skip
        failure = disproof(conn, fmt, marks, present)
        if failure is None:
            held = Marks(entry, at, marks, _stored_state(conn, entry))
            unchanged = None
            # Read after the reads above: the SHARED lock is held.
            if held.state is not None and taken(conn, fmt, "src", present) == marks and file_state(source) == held.state:
                unchanged = frozenset(present)
            return Decision(ident, held, entry=entry, unchanged=unchanged)
        reasons.append(failure)
    if same_path is None:
        # Files of this identity merged before from elsewhere are other files (copies that went on).
        return Decision(ident, why_full="first merge of this source")
    return Decision(ident, why_full=reasons[0], entry=same_path)


def where(source: Path) -> str:
    """How marks name a source's place: ``host:path``, the same whether it was
    merged here or arrived as a bundle (push) from this host."""
    return f"{socket.gethostname()}:{Path(source).resolve()}"


def moved_from(recorded: str | None) -> bool:
    """Whether the file an entry was recorded at is gone from there: this file
    may be that one, moved (a copy left the original where it was)."""
    if not recorded:
        return False
    host, sep, rest = recorded.partition(":")
    if sep and not recorded.startswith("/"):
        if host != socket.gethostname():
            return False
        recorded = rest
    return not Path(recorded).exists()


def _stored_state(conn: apsw.Connection, entry: int) -> str | None:
    if not bookkeeping.has(conn, "_dagsync_mark_files"):
        return None
    for (state,) in conn.execute("SELECT state FROM main._dagsync_mark_files WHERE source = ?", (entry,)):
        return state
    return None


def _rewritten(conn: apsw.Connection) -> str | None:
    for (value,) in conn.execute("SELECT value FROM main._dagsync_meta WHERE key = 'rewritten'"):
        return value
    return None


def disproof(conn: apsw.Connection, fmt: Format, marks: dict[str, tuple[int, str | None]], present: set[str]) -> str | None:
    """Why ``marks`` do not hold for the source ``src`` now, or None when they do."""
    # Rows keyed by their own content (attachments, fragments): llm logs one
    # again by replacing it, which moves it to the end of its table.
    relogged = {proof.table for proof in fmt.proven}
    for name in marked_tables(fmt, present):
        mark, key = marks.get(name, (0, None))
        if not mark:
            continue
        now = [row[0] for row in conn.execute(f'SELECT {key_sql(fmt, name)} FROM src."{name}" WHERE rowid = ?', (mark,))]
        if not now and name in relogged and next(iter(conn.execute(f'SELECT max(rowid) > ? FROM src."{name}"', (mark,))))[0]:
            # Moved on by a replace: whatever lies below the mark now is proven by its
            # key when copied, and one a new row refers to is found there (delta).
            continue
        if not now:
            return f"the source's {name} row {mark}, merged before, is gone (rows deleted or renumbered: gc, llm logs rm, VACUUM)"
        if now[0] != key:
            return f"the source's {name} row {mark} is another row than the one merged before (renumbered, or another file)"
    for name, (mark, _) in marks.items():
        if mark and name not in present:
            return f"the source has no {name} table any more"
    return None


def save(
    conn: apsw.Connection,
    fmt: Format,
    decision: Decision,
    source: str,
    label: str,
    marks: dict[str, tuple[int, str | None]],
    pointers: str,
    state: str | None = None,
) -> None:
    """Record ``marks`` for the source, and its pointer rows as ``pointers``
    has them: ``src`` (a delta or a bundle, read whole), or ``temp`` (the
    source's rows as of the merge's bounds, ``core.SourceMerge.attach``),
    where they point at a message the merge's plan held (``temp.msg_map``).
    ``state``: the source file's state read with them (``file_state``),
    kept only if every pointer row is recorded.
    Call inside the merge's last write transaction."""
    bookkeeping.ensure(conn)
    entry = decision.marks.entry if decision.marks else decision.entry
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    values = (decision.identity, source, label, now, _rewritten(conn))
    if entry is None:
        conn.execute(
            "INSERT INTO main._dagsync_sources (identity, path, label, merged_at, rewritten) VALUES (?, ?, ?, ?, ?)", values
        )
        entry = conn.last_insert_rowid()
    else:
        if decision.marks is None:
            # Merged in full: the entry's old records no longer describe this file.
            conn.execute("DELETE FROM main._dagsync_mark_pointers WHERE source = ?", (entry,))
            conn.execute("DELETE FROM main._dagsync_mark_digests WHERE source = ?", (entry,))
            conn.execute("DELETE FROM main._dagsync_marks WHERE source = ?", (entry,))
        conn.execute(
            "UPDATE main._dagsync_sources SET identity = ?, path = ?, label = ?, merged_at = ?, rewritten = ? WHERE id = ?",
            (*values, entry),
        )
    conn.execute("DELETE FROM main._dagsync_mark_files WHERE source = ?", (entry,))  # kept below if it still holds
    conn.executemany(
        "INSERT OR REPLACE INTO main._dagsync_marks (source, tbl, mark, mark_key) VALUES (?, ?, ?, ?)",
        [(entry, name, mark, key) for name, (mark, key) in marks.items()],
    )
    for table in fmt.tables:
        if table.pointer and table.name in marks:
            key = table.natural_key[0]
            rows = f'{pointers}."{table.name}"' if pointers != "temp" else f'temp."marked_{table.name}"'
            changed = (
                f'SELECT s."{key}" AS key, s."{table.pointer}" AS head FROM {rows} s WHERE NOT EXISTS '
                "(SELECT 1 FROM main._dagsync_mark_pointers p WHERE p.source = ?1 AND p.tbl = ?2 "
                f'AND p.key = s."{key}" AND p.head IS s."{table.pointer}") '
                # A head the plan did not hold (a source damaged there) is not recorded: the next merge looks again.
                f'AND (s."{table.pointer}" IS NULL OR EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = s."{table.pointer}"))'
            )
            _update_digest(conn, entry, table.name, changed)
            conn.execute(
                f"INSERT OR REPLACE INTO main._dagsync_mark_pointers (source, tbl, key, head) SELECT ?1, ?2, key, head FROM ({changed})",
                (entry, table.name),
            )
            if state is not None and any(conn.execute(
                f'SELECT 1 FROM {rows} s WHERE s."{table.pointer}" IS NOT NULL '
                f'AND NOT EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = s."{table.pointer}") LIMIT 1'
            )):  # fmt: skip
                state = None  # a pointer row left out: the next merge must look at them all again
    if state is not None:
        conn.execute("INSERT OR REPLACE INTO main._dagsync_mark_files (source, state) VALUES (?, ?)", (entry, state))


def stored_digest(conn: apsw.Connection, entry: int, table: str) -> tuple[int, int] | None:
    """(rows, digest) of the pointer rows the target keeps of entry's ``table``
    (``pointer_digest``), or None where marks from before it was kept are."""
    if not bookkeeping.has(conn, "_dagsync_mark_digests"):
        return None
    for rows, digest in conn.execute(
        "SELECT rows, digest FROM main._dagsync_mark_digests WHERE source = ? AND tbl = ?", (entry, table)
    ):
        return rows, digest + (1 << 63)
    return None


def _update_digest(conn: apsw.Connection, entry: int, table: str, changed: str) -> None:
    """Bring the stored digest of the entry's ``table`` pointer rows up to date with
    the rows ``changed`` (key, head) is about to write: each replaced row's part
    taken out, each new one's put in. Computed whole where none is stored yet."""
    held = stored_digest(conn, entry, table)
    if held is None:
        held = pointer_digest_of(conn.execute(
            "SELECT key, head FROM main._dagsync_mark_pointers WHERE source = ? AND tbl = ?", (entry, table)
        ))  # fmt: skip
    count, total = held
    for key, head, old, replaced in list(conn.execute(
        f"SELECT c.key, c.head, p.head, p.key IS NOT NULL FROM ({changed}) c LEFT JOIN main._dagsync_mark_pointers p "
        "ON p.source = ?1 AND p.tbl = ?2 AND p.key = c.key",
        (entry, table),
    )):  # fmt: skip
        if replaced:
            total -= row_hash(key, old)
        else:
            count += 1
        total += row_hash(key, head)
    conn.execute(
        "INSERT OR REPLACE INTO main._dagsync_mark_digests (source, tbl, rows, digest) VALUES (?, ?, ?, ?)",
        (entry, table, count, (total % (1 << 64)) - (1 << 63)),
    )


def pointer_digest(conn: apsw.Connection, schema: str, table: str, key: str, pointer: str, bound: int | None = None) -> tuple[int, int]:
    """(rows, digest) of a pointer table's (key, pointer) pairs: the digest is a
    sum of 64-bit hashes, so a row's part can be taken out and put back."""
    within = f"WHERE rowid <= {int(bound)}" if bound is not None else ""
    return pointer_digest_of(conn.execute(f'SELECT "{key}", "{pointer}" FROM {schema}."{table}" {within}'))


def pointer_digest_of(rows: Iterable[tuple[object, object]]) -> tuple[int, int]:
    """(rows, digest) of (key, pointer) pairs, as ``pointer_digest``."""
    count = total = 0
    for k, head in rows:
        count += 1
        total += row_hash(k, head)
    return count, total % (1 << 64)


def row_hash(key: object, head: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr((key, head)).encode(), digest_size=8).digest(), "big")
