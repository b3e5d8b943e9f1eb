"""Messages both files hold: one key must stand for one content on both sides.

The plan takes a message the target already holds - the same hash (llm),
the same id and identity (dag) or another row with its identity (dag,
``MAPPED``) - for that row, and copies nothing of it; the proofs
(``proofs.MessageProofs``) cover only what is copied. Should the two files'
rows differ in what the key is a hash of - role, metadata, a part changed,
lost or added (``Format.message_content``, ``part_content``) - one of them
is damaged, and which cannot be told from the files: a conflict, named,
and nothing merged.

Compared as values, not re-hashed: a part matched by its message and its
place (``Format.part_order``) must hold the same value in each column; a
packed value (a reference into its file's blob store) stands for the
sha256 its reference names, the same as an inline value of that sha256,
so no blob is read; integer ids inside JSON (llm's fragment references),
which mean nothing outside their file, are compared as the keys they name.

Messages matched by key are compared in a thread on its own read-only
connections (``SharedContent``), while the plan runs: one pass over the
source's messages, a lookup each in the target's index, and only the
messages both hold go on to their parts (benchmarks' 55,000-conversation
families, ~505k messages a file, warm, alone: dag 1.9 s, llm 4.2 s; three
passes over every part took 5 s and 11 s). A thin source (a delta, a
bundle) holds only what is new, so an incremental merge compares what it
brings. ``MAPPED`` pairs exist only in the plan's
temp tables, and are compared there (``compare_mapped``), a lookup each.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import apsw

from dagsync import others
from dagsync.db import harden
from dagsync.formats import Format, JsonRef, Key
from dagsync.merge.core import MAX_CONFLICTS_SHOWN, SourceMerge
from dagsync.merge.messages import MAPPED, role_conflict
from dagsync.packed import Blobs, sha256, value_hash_sql
from dagsync.transactions import BUSY_TIMEOUT_MS

__all__ = ["SharedContent", "compare_mapped"]

# How many differing messages each pass looks for: enough to name the first
# few, and to say how many more (a damaged file differs in many, or in one).
LOOKED_FOR = MAX_CONFLICTS_SHOWN * 10


def _differs(key: str, what: str, mapped_to: str | None = None) -> str:
    return f"message {_named(key, mapped_to)} has other {what} in the target than in the source, under the same hash"


def _named(key: str, mapped_to: str | None) -> str:
    return key if mapped_to is None else f"{key} (in the target as {mapped_to})"


class SharedContent:
    """Messages the source and target both hold under one key, compared in a thread.

    ``wait`` gives what differs, worded as conflicts; the plan itself reads
    no more of a message the target holds than its key and identity.
    """

    def __init__(self, run: SourceMerge) -> None:
        self.fmt = run.fmt
        self.source, self.target = run.file, run.db.path  # the file copied from: a delta's rows alone
        self.found: list[str] = []
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shared content", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, run: SourceMerge) -> SharedContent | None:
        """Compare what the source shares with the target, if the target holds anything."""
        if not run.one(f"SELECT 1 FROM main.messages WHERE {run.fmt.message_key} != '{_root(run.fmt)}' LIMIT 1"):
            return None
        return cls(run)

    def _run(self) -> None:
        try:
            uri = "file:" + urllib.parse.quote(str(Path(self.target).resolve())) + "?mode=ro"
            with others.own_open(str(self.target)):  # nobody waiting for the merge's locks
                conn = apsw.Connection(uri, flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI)
            try:
                harden(conn)
                conn.setbusytimeout(BUSY_TIMEOUT_MS)
                conn.execute("ATTACH DATABASE ? AS src", (str(self.source),))
                register_functions(conn, self.fmt)
                self.found.extend(_compare(conn, self.fmt))
            finally:
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), in the merge thread
            self.failure = exc

    def stop(self) -> None:
        """Let the thread finish (the merge failed for another reason)."""
        self._thread.join()

    def wait(self) -> list[str]:
        """:raises apsw.Error, BlobError: a file could not be read (the plan's own reads say more)."""
        self._thread.join()
        if self.failure is not None:
            raise self.failure
        return self.found


def compare_mapped(run: SourceMerge) -> None:
    """Each source message the plan found under another id in the target
    (``messages.MAPPED``: the same parent and content hash) holds what that
    row holds: its parts are not copied, and its calls and heads will point there."""
    c = run.conn
    if not run.one("SELECT 1 FROM temp.msg_map WHERE kind = ? LIMIT 1", (MAPPED,)):
        return
    register_functions(c, run.fmt)
    pairs = f"SELECT src, dst FROM temp.msg_map WHERE kind = {MAPPED}"
    for conflict in _compare(c, run.fmt, pairs):
        run.conflict(conflict)


def _compare(conn: apsw.Connection, fmt: Format, pairs: str | None = None) -> Iterator[str]:
    """What differs between messages of ``src`` and ``main``: matched by key,
    or, given ``pairs`` (SQL of ``(src, dst)`` keys), by those pairs.

    One pass over the messages both hold, a lookup each in the target; only
    those go on to their parts, compared both ways (a part changed or added,
    a part lost), each part a lookup by message and place on the other side.
    A source message the target lacks costs its one lookup."""
    key, parts = fmt.message_key, fmt.table(fmt.part_table)
    owner, order = parts.owned_by, fmt.part_order
    assert owner is not None
    each = [_value_differs(fmt, "messages", c, "s", "t") for c in fmt.message_content]
    columns = ", ".join(f'{d}, s."{c}", t."{c}"' for d, c in zip(each, fmt.message_content, strict=True))
    content = " OR ".join(each)
    differ = " OR ".join(_value_differs(fmt, parts.name, c, "sp", "tp") for c in fmt.part_content)
    parts_differ = (
        f'EXISTS (SELECT 1 FROM src."{parts.name}" sp LEFT JOIN main."{parts.name}" tp '
        f'ON tp."{owner}" = t.{key} AND tp."{order}" IS sp."{order}" '
        f'WHERE sp."{owner}" = s.{key} AND (tp."{owner}" IS NULL OR {differ})) '
        f'OR EXISTS (SELECT 1 FROM main."{parts.name}" tp WHERE tp."{owner}" = t.{key} AND NOT EXISTS '
        f'(SELECT 1 FROM src."{parts.name}" sp WHERE sp."{owner}" = s.{key} AND sp."{order}" IS tp."{order}"))'
    )
    if pairs is None:  # the source's messages in file order
        both = f"src.messages s JOIN main.messages t ON t.{key} = s.{key} AND {_same_identity(fmt)}"
    else:  # a mapped pair has the same identity under its mapped parent
        both = f"({pairs}) p JOIN src.messages s ON s.{key} = p.src JOIN main.messages t ON t.{key} = p.dst"
    query = (
        f"SELECT s.{key}, t.{key}, ({parts_differ}), {columns} FROM {both} "
        f"WHERE {content} OR {parts_differ} LIMIT ?"
    )
    for src, dst, other_parts, *values in conn.execute(query, (LOOKED_FOR,)):
        mapped_to = None if src == dst else dst
        for column, (differs, ours, theirs) in zip(fmt.message_content, _threes(values), strict=True):
            if differs and column == "role":
                yield role_conflict(_named(src, mapped_to), theirs, ours)
            elif differs:
                yield _differs(src, column, mapped_to)
        if other_parts:
            yield _differs(src, "parts", mapped_to)


def _threes(values: list[Any]) -> Iterator[tuple[Any, Any, Any]]:
    return zip(values[::3], values[1::3], values[2::3], strict=True)


def _same_identity(fmt: Format) -> str:
    """SQL true when ``s`` and ``t``, under one key, are one message: a dag
    row with another parent or hash under the same id is a conflict the plan names."""
    if fmt.table("messages").key is Key.DAG_MESSAGE:
        p = fmt.parent_column
        return f"t.{p} IS s.{p} AND t.content_hash IS s.content_hash"
    return "1"  # the key is the identity


def _root(fmt: Format) -> str:
    return fmt.root_id or ""


# -- values ------------------------------------------------------------------------------


def _value_differs(fmt: Format, table: str, column: str, s: str, t: str) -> str:
    """SQL true when ``column`` of rows ``s`` (source) and ``t`` (target) holds other values."""
    a, b = f'{s}."{column}"', f'{t}."{column}"'
    expr = f"{a} IS NOT {b}"
    packed = next((p for p in fmt.packed if (p.table, p.column) == (table, column)), None)
    if packed is not None:
        expr += f" AND {value_hash_sql(packed, s)} IS NOT {value_hash_sql(packed, t)}"
    for i, (ref_table, ref) in enumerate(_json_refs(fmt)):
        if (ref_table, ref.column) == (table, column):
            expr += f" AND dagsync_refs_src_{i}({a}) IS NOT dagsync_refs_main_{i}({b})"
    return f"({expr})"


def _json_refs(fmt: Format) -> list[tuple[str, JsonRef]]:
    """Every JSON column of the format with ids of another table, and its table, numbered as the SQL functions are."""
    return [(t.name, r) for t in fmt.tables for r in t.json_refs]


def register_functions(conn: apsw.Connection, fmt: Format) -> None:
    """``dagsync_sha256(bytes)`` (``packed.value_hash_sql``); and for each JSON column with ids
    of another table, ``dagsync_refs_{src,main}_N(value)``: the JSON with each
    id replaced by that row's key in that file (a packed value resolved first)."""
    conn.create_scalar_function("dagsync_sha256", sha256, 1, deterministic=True)
    for i, (table, ref) in enumerate(_json_refs(fmt)):
        holds = next((p.holds for p in fmt.packed if (p.table, p.column) == (table, ref.column)), None)
        for schema in ("src", "main"):
            conn.create_scalar_function(
                f"dagsync_refs_{schema}_{i}", _keyed_refs(conn, fmt, ref, schema, holds), 1, deterministic=False
            )


def _keyed_refs(conn: apsw.Connection, fmt: Format, ref: JsonRef, schema: str, holds: str | None) -> Callable[[Any], Any]:
    blobs = Blobs(conn, schema)
    natural = fmt.table(ref.table).natural_key[0]
    lookup = f'SELECT "{natural}" FROM {schema}."{ref.table}" WHERE id = ?'

    def key_of(row_id: Any) -> str:
        row = next(iter(conn.execute(lookup, (row_id,))), None) if isinstance(row_id, int) else None
        return f"{ref.table} {row_id!r}, which {schema} lacks" if row is None else str(row[0])

    def keyed(value: Any) -> Any:
        if holds is not None:
            value = blobs.resolve_bytes(value, holds)
        try:
            text = value.decode("utf-8") if isinstance(value, bytes) else value
            return ref.rewrite(text, key_of) if isinstance(text, str) else value
        except (ValueError, TypeError, AttributeError):
            return value  # not JSON of that shape: compared as it is

    return keyed
