"""Bundles: a source's rows beyond a target's marks, in a file, for a target elsewhere.

A bundle is an ordinary SQLite file of the source's format (``merge.delta``)
holding only what lies beyond the marks a target keeps of that source, plus
``_dagsync_bundle``: what it was made from and against. It is *thin*: a
reference in it may resolve in the target alone. ``merge TARGET BUNDLE``
merges it with every guarantee of a merge, and refuses it whole when it
cannot be sure of it:

* made against marks the target does not hold (the target never merged the
  rows the bundle leaves out, or lost them: a restore, gc) - it says so and
  what to run; nothing is written;
* a reference resolving neither in the bundle nor in the target - the
  merge's own dangling checks;
* a pointer row the source moved in place that the bundle left out: each
  pointer table's digest (``marks.pointer_digest``) over the source's rows,
  checked against the rows the target last merged plus the bundle's.

``marks_of`` is what a target tells a machine that makes a bundle for it
(``dagsync marks``; over ssh, ``push`` asks for it); ``make`` makes one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import apsw

from dagsync import __version__, bookkeeping, packed
from dagsync.db import harden, open_unchecked_source
from dagsync.errors import DagsyncError
from dagsync.formats import Format
from dagsync.merge import delta, marks
from dagsync.merge.core import source_label

__all__ = ["BUNDLE_TABLE", "WHOLE_AGAIN", "BundleReport", "Received", "make", "marks_of", "meta", "received"]

BUNDLE_TABLE = "_dagsync_bundle"
# What a target that forgot rows a bundle's new rows refer to asks for (merge,
# marks.forgotten_below); push and pull then send the whole source.
WHOLE_AGAIN = "make the bundle again without --marks (the whole source)"
MARKS_VERSION = 1


@dataclass(frozen=True)
class BundleReport:
    bundle: str
    source: str
    format: str
    identity: str
    against: str | None  # the target entry's path the bundle was made against; None: from the start
    why_whole: str | None  # why the bundle holds the whole source, if it does
    rows: dict[str, int]
    bytes: int
    seconds: float

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


def marks_of(target: str | os.PathLike[str]) -> dict:
    """What ``target`` has merged of each source: its identity, where it was,
    and the marks (table -> [rowid, key there]). Read-only."""
    if not Path(target).exists() or not Path(target).stat().st_size:
        return {"dagsync_marks": MARKS_VERSION, "format": None, "target": str(target), "exists": False, "sources": []}
    with open_unchecked_source(target) as db:
        sources = []
        if bookkeeping.has(db.conn, "_dagsync_sources"):
            # Marks made before the file was last rewritten (gc ...) no longer hold: not given.
            for entry, identity, path, label, merged_at in list(db.conn.execute(
                "SELECT id, identity, path, label, merged_at FROM _dagsync_sources WHERE rewritten IS "
                "(SELECT value FROM _dagsync_meta WHERE key = 'rewritten') ORDER BY id"
            )):  # fmt: skip
                held = {tbl: [mark, key] for tbl, mark, key in db.conn.execute(
                    "SELECT tbl, mark, mark_key FROM _dagsync_marks WHERE source = ?", (entry,)
                )}  # fmt: skip
                sources.append({"identity": identity, "path": path, "label": label, "merged_at": merged_at, "marks": held})
        return {
            "dagsync_marks": MARKS_VERSION, "format": db.format.name, "target": str(target), "exists": True,
            "sources": sources,
        }  # fmt: skip


def make(
    source: str | os.PathLike[str],
    target_marks: dict | None,
    out: str | os.PathLike[str],
    *,
    label: str | None = None,
    all_pointers: bool = False,
) -> BundleReport:
    """Write to ``out`` (new, 0600) what ``source`` holds beyond the marks in
    ``target_marks`` (``marks_of`` of the target; None: everything), and with
    ``all_pointers`` every pointer row (thread tip, conversation head), moved or not.

    :raises DagsyncError: ``out`` exists, or the marks are of another format.
    """
    started = time.perf_counter()
    source, out = Path(source), Path(out)
    if out.exists():
        raise DagsyncError(f"{out} exists; give a new file for the bundle")
    with open_unchecked_source(source) as src:
        fmt = src.format
    if target_marks is not None and target_marks.get("format") not in (None, fmt.name):
        raise DagsyncError(
            f"the marks are of a {target_marks['format']}-format target but {source} is in the {fmt.name} format"
        )
    conn = apsw.Connection(":memory:", flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI)
    harden(conn)
    uri = "file:" + _quote(source) + "?mode=ro"
    conn.execute("ATTACH DATABASE ? AS src", (uri,))
    fd = os.open(out, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    try:
        if packed.is_packed(conn, "src"):
            # Its rows hold references into a store that a bundle does not carry.
            raise DagsyncError(
                f"{source} is packed (dagsync pack): a bundle carries rows but not the blob store they refer to; "
                f"merge {source} itself (merge reads packed files), or unpack a copy of it and bundle that"
            )
        present = {n for (n,) in conn.execute("SELECT name FROM src.sqlite_schema WHERE type = 'table'")}
        conn.execute("BEGIN")
        try:
            identity = marks.identity(conn, fmt)
            since, against, why = _against(conn, fmt, identity, target_marks, present, marks.where(source))
        finally:
            conn.execute("COMMIT")
        if all_pointers:
            since = {t: m for t, m in since.items() if not (t in fmt.columns and _pointer(fmt, t))}
        made = delta.extract(conn, fmt, since, present, out, snapshot=None)
        _record(out, {
            "dagsync": __version__, "format": fmt.name, "identity": identity,
            "source": marks.where(source), "label": label or source_label(source),
            "since": since, "now": made.now, "digests": {} if all_pointers else made.digests, "rows": made.rows,
            "against": against, "why_whole": why,
            "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })  # fmt: skip
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    finally:
        conn.close()
    return BundleReport(
        str(out), str(source), fmt.name, identity, against, why, made.rows, out.stat().st_size,
        round(time.perf_counter() - started, 3),
    )  # fmt: skip


def _pointer(fmt: Format, table: str) -> bool:
    return any(t.name == table and t.pointer for t in fmt.tables)


def _quote(path: Path) -> str:
    import urllib.parse

    return urllib.parse.quote(str(path.resolve()))


def _against(
    conn: apsw.Connection, fmt: Format, identity: str, target_marks: dict | None, present: set[str], where: str
) -> tuple[dict[str, tuple[int, str | None]], str | None, str | None]:
    """The marks to make the bundle beyond: the first entry of the source's
    identity whose marks hold for it; none (the whole source) and why, else."""
    if target_marks is None:
        return {}, None, "no marks given"
    if not target_marks.get("exists", True):
        return {}, None, "a new target"
    if target_marks.get("whole_because"):
        return {}, None, str(target_marks["whole_because"])  # the target asked for the whole source
    reasons = []
    for entry in target_marks.get("sources", ()):
        if entry.get("identity") != identity:
            continue
        if entry.get("path") != where and not marks.moved_from(entry.get("path")):
            continue  # another file of this identity: a copy that went on elsewhere
        held = {tbl: (int(m), k) for tbl, (m, k) in entry["marks"].items()}
        failure = marks.disproof(conn, fmt, held, present)
        if failure is None:
            return held, entry.get("path"), None
        reasons.append(failure)
    return {}, None, reasons[0] if reasons else "the target has not merged this source"


def _record(out: Path, what: dict) -> None:
    """Write the bundle's record into it, and the whole file to the disk."""
    conn = apsw.Connection(str(out))
    try:
        conn.execute("PRAGMA journal_mode = OFF")
        with conn:
            conn.execute(f"CREATE TABLE {BUNDLE_TABLE} (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            conn.executemany(
                f"INSERT INTO {BUNDLE_TABLE} VALUES (?, ?)", [(k, json.dumps(v)) for k, v in what.items()]
            )
    finally:
        conn.close()
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def meta(conn: apsw.Connection, schema: str = "src") -> dict | None:
    """A bundle's record of what it was made from and against; None for an ordinary file."""
    if not bookkeeping.has(conn, BUNDLE_TABLE, schema):
        return None
    return {k: json.loads(v) for k, v in conn.execute(f"SELECT key, value FROM {schema}.{BUNDLE_TABLE}")}


@dataclass(frozen=True)
class Received:
    """How a target takes a bundle: the marks entry it extends (None: a new one),
    and the source's marks once merged."""

    identity: str
    entry: int | None
    now: dict[str, tuple[int, str | None]]
    label: str
    source: str
    # A bundle of the whole source: the entry it replaces (its source's, by identity
    # and path), whose marks would otherwise stand beside the new ones.
    replaces: int | None = None


def received(conn: apsw.Connection, fmt: Format, bundle: Path, found: dict) -> Received:
    """Check that the target (``main``) can take the bundle attached as ``src``.

    :raises DagsyncError: made against marks the target does not hold, or
        leaving out pointer rows its source moved in place; nothing is written.
    """
    if found.get("format") != fmt.name:
        raise DagsyncError(f"{bundle} is a bundle of a {found.get('format')}-format file; the target is {fmt.name}")
    since = {tbl: (int(m), k) for tbl, (m, k) in found["since"].items()}
    identity = found["identity"]
    entry = None
    if since:
        entry = _holding(conn, identity, since)
        if entry is None:
            raise DagsyncError(
                f"{bundle} was made against marks the target does not hold (it has not merged the rows the "
                f"bundle leaves out, or has lost them since); nothing was merged - make a new bundle against "
                f"the target's marks now (`dagsync marks TARGET`, then `dagsync bundle`)"
            )
    for table, (count, digest) in found.get("digests", {}).items():
        if _expected(conn, fmt, entry, table) != (count, digest):
            raise DagsyncError(
                f"{bundle} leaves out {table} rows its source changed in place (the digest of its pointers "
                "does not match); nothing was merged - make the bundle again with --all-pointers"
            )
    replaces = None
    if not since and bookkeeping.has(conn, "_dagsync_sources"):
        replaces = next(iter(conn.execute(
            "SELECT id FROM main._dagsync_sources WHERE identity = ? AND path = ? ORDER BY id LIMIT 1",
            (identity, found["source"]),
        )), (None,))[0]  # fmt: skip
    now = {t: (int(m), k) for t, (m, k) in found["now"].items()}
    return Received(identity, entry, now, found["label"], found["source"], replaces)


def _holding(conn: apsw.Connection, identity: str, since: dict[str, tuple[int, str | None]]) -> int | None:
    """The target's entry for ``identity`` whose marks reach at least ``since`` in every table."""
    if not bookkeeping.has(conn, "_dagsync_sources"):
        return None
    for (entry,) in list(conn.execute(
        "SELECT id FROM main._dagsync_sources WHERE identity = ? AND rewritten IS "
        "(SELECT value FROM main._dagsync_meta WHERE key = 'rewritten') ORDER BY id",
        (identity,),
    )):  # fmt: skip
        held = {t: m for t, m in conn.execute("SELECT tbl, mark FROM main._dagsync_marks WHERE source = ?", (entry,))}
        if all(held.get(t, 0) >= m for t, (m, _) in since.items()):
            return entry
    return None


def _expected(conn: apsw.Connection, fmt: Format, entry: int | None, table: str) -> tuple[int, int]:
    """The digest of ``table``'s pointer rows the source must have: the rows the target
    last merged from it, each replaced by the bundle's where the bundle has one.
    From the digest the target keeps of those rows, in the time the bundle's own take."""
    t = fmt.table(table)
    key, pointer = t.natural_key[0], t.pointer
    count, total = marks.pointer_digest(conn, "src", table, key, pointer)
    if entry is None:
        return count, total
    recorded = "SELECT p.key, p.head FROM main._dagsync_mark_pointers p WHERE p.source = ? AND p.tbl = ? AND "
    held = marks.stored_digest(conn, entry, table)
    if held is None:  # marks kept before their digest was: each row the bundle does not replace
        others = marks.pointer_digest_of(conn.execute(
            f'{recorded} NOT EXISTS (SELECT 1 FROM src."{table}" s WHERE s."{key}" = p.key)', (entry, table)
        ))  # fmt: skip
        return count + others[0], (total + others[1]) % (1 << 64)
    replaced = marks.pointer_digest_of(conn.execute(f'{recorded} p.key IN (SELECT "{key}" FROM src."{table}")', (entry, table)))
    return count + held[0] - replaced[0], (total + held[1] - replaced[1]) % (1 << 64)
