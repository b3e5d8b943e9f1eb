"""packed: what a packed file is, and how to read one.

``dagsync pack`` (``blobs.py``) moves payloads into a content-addressed zstd
store inside the file and leaves a short reference in each row; every
dagsync command reads such files, through this module.

The format (docs/blobs.md says it for other programs):

* ``blobs(hash TEXT PRIMARY KEY, size INTEGER NOT NULL, dict INTEGER, data BLOB NOT NULL)``:
  ``hash`` is the lowercase hex sha256 of the exact payload bytes (a text
  payload's UTF-8); ``size`` their length; ``data`` one zstd frame of them
  (content size in its header), made with the dictionary whose ``id`` is
  ``dict`` when that is not NULL.
* ``blob_dicts(id INTEGER PRIMARY KEY, hash TEXT NOT NULL UNIQUE, data BLOB NOT NULL)``:
  zstd dictionaries, each known by the sha256 of its bytes, so two files'
  dictionaries never clash and merge can copy them by key (its ``id`` is
  the file's own, and short in every blob row).
* **A packed value** is stored with the storage class its column otherwise
  never holds, so a payload is never mistaken for a reference, whatever it
  says: in a column of text (``parts.text``, ``message_parts.content`` ...)
  a BLOB of ``dagsync:`` and the 32 bytes of the blob's sha256 (40 bytes,
  ``SHORT_LENGTH``); in a column of bytes (``attachments.content``) TEXT,
  ``dagsync:`` and the hash in hex (72 characters, ``MARKER_LENGTH``).
  Which columns are packed is data: ``Format.packed``.
* ``_dagsync_meta`` keeps the settings new rows are packed with:
  ``pack_level``, ``pack_threshold``, ``pack_dict`` (a dictionary hash or ''),
  and ``pack_generation``, moved on by every transaction that writes references.

Files packed before 2026-12-07 (the first store) keep being read as they are:
their references in text columns are the 72-byte form (``dagsync:`` and hex,
as a BLOB), and their ``blobs.dict`` holds the dictionary's hash, in a
``blob_dicts(hash TEXT PRIMARY KEY, data BLOB NOT NULL)`` without ids. Every
reader here takes either form (``blob_hash_sql``, ``reference``,
``Blobs.decompressor``); packing such a file again writes the short form for
what it packs, and one file may hold both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import apsw
import zstandard

from dagsync import bookkeeping
from dagsync.errors import BlobError
from dagsync.formats import PackedColumn

__all__ = [
    "DDL", "FRAME_HEADER_MAX", "MARKER_LENGTH", "MAX_PAYLOAD", "ONE_SHOT", "PREFIX", "STREAM_CHUNK", "SHORT_LENGTH", "Blobs", "blob_hash_sql", "damaged", "dict_ids", "frame_sql",
    "generation", "is_packed", "lost_store", "lost_store_error", "marker_sql", "meta", "payload_bytes", "proof", "prove_referenced",
    "reference", "reference_sql", "reference_values", "register_functions", "sha256", "value_hash_sql",
]  # fmt: skip

PREFIX = "dagsync:"
# A reference in a column of bytes: TEXT, the prefix and the hash in hex.
MARKER_LENGTH = len(PREFIX) + 64
# A reference in a column of text: a BLOB, the prefix and the hash's 32 bytes.
SHORT_LENGTH = len(PREFIX) + 32
PREFIX_HEX = PREFIX.encode().hex()

DDL = """
CREATE TABLE IF NOT EXISTS blob_dicts (
    id INTEGER PRIMARY KEY,  -- what blobs.dict says: short, this file's own
    hash TEXT NOT NULL UNIQUE,  -- sha256 hex of the dictionary bytes
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    hash TEXT PRIMARY KEY,  -- sha256 hex of the payload bytes
    size INTEGER NOT NULL,  -- payload length in bytes
    dict INTEGER REFERENCES blob_dicts(id),  -- the dictionary data was compressed with, or NULL
    data BLOB NOT NULL  -- one zstd frame
);
"""


def is_packed(conn: apsw.Connection, schema: str = "main") -> bool:
    """Whether the database has a blob store."""
    return bookkeeping.has(conn, "blobs", schema)


def generation(conn: apsw.Connection) -> str | None:
    """A counter every transaction that writes blob references moves on (gc compares it)."""
    return meta(conn, "pack_generation")


def dict_ids(conn: apsw.Connection, schema: str = "main") -> bool:
    """Whether the store's blobs name their dictionary by ``blob_dicts.id`` (the
    first store named it by hash: the module's docstring)."""
    return any(name == "id" for (name,) in conn.execute(f"SELECT name FROM pragma_table_info('blob_dicts', '{schema}')"))


def marker_sql(column: PackedColumn, alias: str) -> str:
    """SQL true when ``alias.column`` holds a reference to a blob (either form, in a column of text)."""
    value = f'{alias}."{column.column}"'
    if column.holds == "text":
        return (
            f"(typeof({value}) = 'blob' AND length({value}) IN ({SHORT_LENGTH}, {MARKER_LENGTH}) "
            f"AND substr({value}, 1, 8) = X'{PREFIX_HEX}')"
        )
    return f"(typeof({value}) = 'text' AND length({value}) = {MARKER_LENGTH} AND substr({value}, 1, 8) = '{PREFIX}')"


def blob_hash_sql(column: PackedColumn, alias: str) -> str:
    """SQL for the blob hash (``blobs.hash``) a reference in ``alias.column`` holds;
    only meaningful where ``marker_sql`` is true."""
    value = f'{alias}."{column.column}"'
    if column.holds == "text":
        return f"(CASE WHEN length({value}) = {SHORT_LENGTH} THEN lower(hex(substr({value}, 9))) ELSE substr(CAST({value} AS TEXT), 9) END)"
    return f"substr({value}, 9)"


def value_hash_sql(column: PackedColumn, alias: str) -> str:
    """SQL for the sha256 of what ``alias.column`` holds: the hash a reference names,
    or the hash of an inline value's bytes (read as bytes: a damaged text that is
    not UTF-8 is hashed, not decoded); NULL stays NULL. Needs ``dagsync_sha256``."""
    value = f'{alias}."{column.column}"'
    return (
        f"(CASE WHEN {value} IS NULL THEN NULL WHEN {marker_sql(column, alias)} THEN {blob_hash_sql(column, alias)} "
        f"ELSE dagsync_sha256(CAST({value} AS BLOB)) END)"
    )


def reference_sql(column: PackedColumn, key: str) -> str:
    """SQL for the reference a packed value of ``column`` becomes, from the SQL of its blob's hash."""
    if column.holds == "text":
        return f"unhex('{PREFIX_HEX}' || {key})"
    return f"'{PREFIX}' || {key}"


def reference_values(blob_hash: str) -> tuple[bytes, bytes, str]:
    """Every value a reference to ``blob_hash`` may be stored as: short and first form in a
    column of text, and in a column of bytes."""
    return PREFIX.encode() + bytes.fromhex(blob_hash), (PREFIX + blob_hash).encode(), PREFIX + blob_hash


def payload_bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def sha256(value: str | bytes) -> str:
    return hashlib.sha256(payload_bytes(value)).hexdigest()


# No payload can be longer than the longest value SQLite holds (SQLITE_MAX_LENGTH,
# 1e9 bytes by default): a blob that says it is longer is refused unread.
MAX_PAYLOAD = 1_000_000_000
# ``Blobs.problem`` decompresses a payload up to this long at once, and reads a
# longer one in pieces of STREAM_CHUNK bytes.
ONE_SHOT = 8 << 20
STREAM_CHUNK = 1 << 20
# The longest a zstd frame header can be (ZSTD_FRAMEHEADERSIZE_MAX): what is read to check one.
FRAME_HEADER_MAX = 18


class Blobs:
    """Reads (and, for pack, writes) the blob store of one schema of a connection.

    Every blob is proven when it is read: its frame must declare the size its
    row records (checked before anything is decompressed, so a frame that
    claims gigabytes - a decompression bomb - costs nothing), and what comes
    out must be that long and hash to the blob's key. A blob that fails is
    never returned: ``payload`` raises ``BlobError`` naming it.
    """

    def __init__(self, conn: apsw.Connection, schema: str = "main") -> None:
        self.conn = conn
        self.schema = schema
        self.decompressors: dict[str | None, zstandard.ZstdDecompressor] = {}
        self.present: bool | None = None
        self.lost: bool | None = None  # packed once, its store gone (lost_store)

    @property
    def filename(self) -> str:
        return self.conn.db_filename(self.schema) or self.schema

    def decompressor(self, dict_key: int | str | None) -> zstandard.ZstdDecompressor:
        """For a blob's ``dict``: a dictionary's id, its hash (the first store), or None."""
        if dict_key not in self.decompressors:
            if dict_key is None:
                self.decompressors[None] = zstandard.ZstdDecompressor()
            else:
                by = "id" if isinstance(dict_key, int) else "hash"
                row = None
                if by == "hash" or dict_ids(self.conn, self.schema):
                    row = next(iter(self.conn.execute(
                        f"SELECT CAST(data AS BLOB) FROM {self.schema}.blob_dicts WHERE {by} = ?", (dict_key,)
                    )), None)  # fmt: skip
                if row is None:
                    raise BlobError(f"blob dictionary {dict_key} is missing")
                self.decompressors[dict_key] = zstandard.ZstdDecompressor(
                    dict_data=zstandard.ZstdCompressionDict(row[0])
                )
        return self.decompressors[dict_key]

    def exists(self) -> bool:
        if self.present is None:
            self.present = is_packed(self.conn, self.schema)
        return self.present

    def _row(self, blob_hash: str) -> tuple[str | None, bytes, int] | None:
        if not self.exists():
            return None
        return next(
            iter(self.conn.execute(
                f"SELECT dict, CAST(data AS BLOB), size FROM {self.schema}.blobs WHERE hash = ?", (blob_hash,)
            )),
            None,
        )  # fmt: skip

    def _frame_problem(self, data: bytes, size: Any) -> str | None:
        """What is wrong with a frame's header against its row, before decompressing it."""
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            return f"does not decompress ({exc})"
        if not isinstance(size, int) or size < 0:
            return f"records a size of {size!r}"
        if declared != size:
            said = "no size" if declared < 0 else f"{declared} bytes"
            return f"declares {said}, not its size {size}"
        if size > MAX_PAYLOAD:
            return f"is {size} bytes, longer than any value SQLite holds ({MAX_PAYLOAD})"
        return None

    def damaged(self, blob_hash: str, what: str) -> BlobError:
        """The one-line error for a blob that failed its proof: every command
        proves a blob before it writes anything that depends on it."""
        return damaged(self.filename, blob_hash, what)

    def payload(self, blob_hash: str) -> bytes:
        """The bytes stored under ``blob_hash``, proven by its key and size.

        :raises BlobError: the blob or its dictionary is missing, or the blob
            fails its proof (``damaged``).
        """
        row = self._row(blob_hash)
        if row is None:
            raise self.damaged(blob_hash, "is missing")
        return self.payload_of(blob_hash, *row)

    def payload_of(self, blob_hash: str, dict_key: int | str | None, data: bytes, size: Any) -> bytes:
        """The payload of a blob row, proven by its key and size (``payload``, for a row in hand)."""
        problem = self._frame_problem(data, size)
        if problem is None:
            try:
                # The frame declares ``size`` (checked above): that is all it allocates.
                out = self.decompressor(dict_key).decompress(data)
            except zstandard.ZstdError as exc:
                problem = f"does not decompress ({exc})"
            else:
                problem = proof(blob_hash, size, len(out), sha256(out))
        if problem is not None:
            raise self.damaged(blob_hash, problem)
        return out

    def problem(self, blob_hash: str) -> str | None:
        """What is wrong with the blob (None: it is whole); see ``problem_of``."""
        row = self._row(blob_hash)
        if row is None:
            return "is missing"
        return self.problem_of(blob_hash, *row)

    def problem_of(self, blob_hash: str, dict_key: int | str | None, data: bytes, size: Any) -> str | None:
        """What is wrong with a blob row (None: it is whole). A payload up to
        ONE_SHOT bytes is decompressed at once; a longer one is read in pieces
        of STREAM_CHUNK bytes, so memory stays flat whatever a blob holds.

        :raises BlobError: its dictionary is missing.
        """
        problem = self._frame_problem(data, size)
        if problem is not None:
            return problem
        if size > ONE_SHOT:
            return self._streamed_problem(data, blob_hash, dict_key, size)
        try:
            out = self.decompressor(dict_key).decompress(data)  # allocates ``size``: checked above
        except zstandard.ZstdError as exc:
            return f"does not decompress ({exc})"
        return proof(blob_hash, size, len(out), sha256(out))

    def problem_in_row(self, rowid: int, blob_hash: str, dict_key: int | str | None, frame: Any, size: Any) -> str | None:
        """``problem_of`` for a row read with ``frame_sql``: a long frame (NULL there) is read in pieces."""
        if frame is not None:
            return self.problem_of(blob_hash, dict_key, frame, size)
        try:
            return self.problem_at(rowid, blob_hash, dict_key, size)
        except apsw.SQLError:  # not a BLOB or TEXT at all
            return "has no frame"

    def problem_at(self, rowid: int, blob_hash: str, dict_key: int | str | None, size: Any) -> str | None:
        """``problem_of`` for the blob in row ``rowid`` of the store, its frame read in
        pieces from the file (for a frame longer than ONE_SHOT: never held whole)."""
        with self.conn.blob_open(self.schema, "blobs", "data", rowid, False) as frame:
            problem = self._frame_problem(frame.read(FRAME_HEADER_MAX), size)
            if problem is not None:
                return problem
            frame.seek(0)
            return self._streamed_problem(frame, blob_hash, dict_key, size)

    def _streamed_problem(self, frame: Any, blob_hash: str, dict_key: int | str | None, size: int) -> str | None:
        """Decompress ``frame`` (bytes, or a blob handle) in pieces, proving what comes out."""
        try:
            digest, length = hashlib.sha256(), 0
            reader = self.decompressor(dict_key).stream_reader(frame, read_size=STREAM_CHUNK)
            while piece := reader.read(STREAM_CHUNK):
                length += len(piece)
                if length > size:
                    return f"decompresses to more than its size {size}"
                digest.update(piece)
        except zstandard.ZstdError as exc:
            return f"does not decompress ({exc})"
        return proof(blob_hash, size, length, digest.hexdigest())

    def resolve(self, value: Any, holds: str) -> Any:
        """A column value as llm wrote it: a reference replaced by its payload, anything else as it is.

        A text payload comes back as ``str`` (bytes that are not UTF-8 replaced:
        to get them exactly, use ``resolve_bytes``, as SQL does).
        """
        data = self.resolve_bytes(value, holds)
        if data is value:
            return value
        return data.decode("utf-8", errors="replace") if holds == "text" else data

    def resolve_bytes(self, value: Any, holds: str) -> Any:
        """Like ``resolve``, but a payload always comes back as its exact bytes.

        :raises BlobError: a reference that cannot be proven, or any in a file
            that was packed and has lost its blob store.
        """
        blob_hash = reference(value, holds)
        if blob_hash is None:
            return value
        if not self.exists():
            if self.lost is None:
                self.lost = lost_store(self.conn, self.schema)
            if self.lost:
                raise lost_store_error(self.filename)
            return value  # a file never packed: a value that looks like a reference is just a value
        return self.payload(blob_hash)


def frame_sql(alias: str) -> str:
    """The columns ``Blobs.problem_in_row`` takes, for blob rows ``alias``: a frame longer
    than ONE_SHOT comes as NULL, to be read in pieces (``length`` of a BLOB does not read it)."""
    return (
        f"{alias}.rowid, {alias}.hash, {alias}.dict, "
        f"CASE WHEN length({alias}.data) > {ONE_SHOT} THEN NULL ELSE CAST({alias}.data AS BLOB) END, {alias}.size"
    )


def prove_referenced(
    conn: apsw.Connection, schema: str, refs: str, ranges: Callable[[str], Iterator[tuple[int, int]]]
) -> None:
    """Prove every blob of ``schema`` whose hash is in the temp table ``refs`` (column
    ``hash``), reading the store in rowid ``ranges`` (in file order, not a lookup a blob).

    :raises BlobError: naming the first blob that is missing or fails its proof.
    """
    store = Blobs(conn, schema)
    missing = next(iter(conn.execute(
        f"SELECT r.hash FROM {refs} r WHERE NOT EXISTS (SELECT 1 FROM {schema}.blobs b WHERE b.hash = r.hash) LIMIT 1"
    )), None)  # fmt: skip
    if missing is not None:
        raise damaged(store.filename, missing[0], "is missing")
    rows = conn.cursor()  # closed however this ends, so the caller may drop ``refs``
    try:
        for low, high in ranges(f"{schema}.blobs"):
            for rowid, blob_hash, dict_key, frame, size in rows.execute(
                f"SELECT {frame_sql('b')} FROM {schema}.blobs b "
                f"WHERE b.rowid BETWEEN ? AND ? AND b.hash IN (SELECT hash FROM {refs})",
                (low, high),
            ):
                try:
                    problem = store.problem_in_row(rowid, blob_hash, dict_key, frame, size)
                except BlobError as exc:  # its dictionary is missing
                    problem = f"cannot be read ({exc})"
                if problem is not None:
                    raise damaged(store.filename, blob_hash, problem)
    finally:
        rows.close()


def damaged(filename: str, blob_hash: str, what: str) -> BlobError:
    """The one-line error for blob ``blob_hash`` of ``filename``, which ``what`` says is wrong."""
    return BlobError(
        f"{filename}: blob {blob_hash} {what}; its blob store is damaged and nothing was written - "
        f"run `dagsync verify {filename}` to see all of it, and restore the file from a backup"
    )


def reference(value: Any, holds: str) -> str | None:
    """The blob hash a packed value refers to, or None for a plain value."""
    if holds == "text" and isinstance(value, bytes) and value.startswith(PREFIX.encode()):
        if len(value) == SHORT_LENGTH:
            return value[len(PREFIX) :].hex()
        if len(value) == MARKER_LENGTH:
            return value[len(PREFIX) :].decode("ascii", errors="replace")
    if holds == "blob" and isinstance(value, str) and len(value) == MARKER_LENGTH and value.startswith(PREFIX):
        return value[len(PREFIX) :]
    return None


def proof(blob_hash: str, size: int, length: int, digest: str) -> str | None:
    """What a decompressed payload says against its blob's key and size (None: proven)."""
    if length != size:
        return f"decompresses to {length} bytes, not its size {size}"
    if digest != blob_hash:
        return f"holds a payload that does not hash to its key (it hashes to {digest})"
    return None


def register_functions(conn: apsw.Connection) -> None:
    """``dagsync_unpack(value, holds)`` and ``dagsync_unpack_src(...)``: a value with any
    blob reference resolved, from the main database or the attached ``src``;
    ``dagsync_blob(hash, dict, data, size)``: the proven payload of a row of main's
    ``blobs`` (for a statement that joins the store rather than look each blob up);
    ``dagsync_sha256(bytes)``: the key a payload's blob has."""
    for name, schema in (("dagsync_unpack", "main"), ("dagsync_unpack_src", "src")):
        store = Blobs(conn, schema)
        # Exact bytes: callers CAST them AS TEXT for a text column, byte for byte.
        conn.create_scalar_function(name, store.resolve_bytes, 2, deterministic=False)
    conn.create_scalar_function("dagsync_blob", Blobs(conn).payload_of, 4, deterministic=False)
    conn.create_scalar_function("dagsync_sha256", sha256, 1, deterministic=True)


def meta(conn: apsw.Connection, key: str, schema: str = "main") -> str | None:
    """A setting of the blob store (``_dagsync_meta``), or None."""
    if not bookkeeping.has(conn, "_dagsync_meta", schema):
        return None
    row = next(iter(conn.execute(f"SELECT value FROM {schema}._dagsync_meta WHERE key = ?", (key,))), None)
    return row[0] if row else None


def lost_store(conn: apsw.Connection, schema: str = "main") -> bool:
    """The file was packed (its settings are there; unpack removes them) but its blob store is gone."""
    return meta(conn, "pack_level", schema) is not None and not is_packed(conn, schema)


def lost_store_error(filename: str) -> BlobError:
    return BlobError(
        f"{filename} was packed but has lost its blob store (the blobs table is gone), so its packed values "
        "cannot be read; nothing was written - restore the file from a backup"
    )
