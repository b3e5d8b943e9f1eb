"""packed: what a packed file is, and how to read one.

``dagsync pack`` (``blobs.py``) moves payloads into a content-addressed zstd
store inside the file and leaves a short reference in each row; every
dagsync command reads such files, through this module.

The format (docs/blobs.md says it for other programs):

* ``blobs(hash TEXT PRIMARY KEY, size INTEGER NOT NULL, dict TEXT, data BLOB NOT NULL)``:
  ``hash`` is the lowercase hex sha256 of the exact payload bytes (a text
  payload's UTF-8); ``size`` their length; ``data`` one zstd frame of them
  (content size in its header), made with the dictionary ``dict`` when that
  is not NULL.
* ``blob_dicts(hash TEXT PRIMARY KEY, data BLOB NOT NULL)``: zstd
  dictionaries, keyed by the sha256 of their bytes, so two files'
  dictionaries never clash and merge can copy them by key.
* **A packed value** is ``dagsync:`` followed by the blob's hash (72 ASCII
  characters), stored with the storage class its column otherwise never
  holds: a BLOB in a column of text (``parts.text``, ``message_parts.content``
  ...), TEXT in a column of bytes (``attachments.content``). So a payload is
  never mistaken for a reference, whatever it says. Which columns are packed
  is data: ``Format.packed``.
* ``_dagsync_meta`` keeps the settings new rows are packed with:
  ``pack_level``, ``pack_threshold``, ``pack_dict`` (a dictionary hash or ''),
  and ``pack_generation``, moved on by every transaction that writes references.
"""

from __future__ import annotations

import hashlib
from typing import Any

import apsw
import zstandard

from dagsync import bookkeeping
from dagsync.errors import BlobError
from dagsync.formats import PackedColumn

__all__ = [
    "DDL", "MARKER_LENGTH", "PREFIX", "Blobs", "generation", "is_packed", "marker_sql", "meta",
    "payload_bytes", "register_functions", "sha256",
]  # fmt: skip

PREFIX = "dagsync:"
MARKER_LENGTH = len(PREFIX) + 64

DDL = """
CREATE TABLE IF NOT EXISTS blob_dicts (
    hash TEXT PRIMARY KEY,  -- sha256 hex of the dictionary bytes
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    hash TEXT PRIMARY KEY,  -- sha256 hex of the payload bytes
    size INTEGER NOT NULL,  -- payload length in bytes
    dict TEXT REFERENCES blob_dicts(hash),  -- the dictionary data was compressed with, or NULL
    data BLOB NOT NULL  -- one zstd frame
);
"""


def is_packed(conn: apsw.Connection, schema: str = "main") -> bool:
    """Whether the database has a blob store."""
    return bookkeeping.has(conn, "blobs", schema)


def generation(conn: apsw.Connection) -> str | None:
    """A counter every transaction that writes blob references moves on (gc compares it)."""
    return meta(conn, "pack_generation")


def marker_sql(column: PackedColumn, alias: str) -> str:
    """SQL true when ``alias.column`` holds a reference to a blob."""
    other = "blob" if column.holds == "text" else "text"
    value = f'{alias}."{column.column}"'
    return f"(typeof({value}) = '{other}' AND length({value}) = {MARKER_LENGTH} AND substr(CAST({value} AS TEXT), 1, 8) = '{PREFIX}')"


def payload_bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def sha256(value: str | bytes) -> str:
    return hashlib.sha256(payload_bytes(value)).hexdigest()


class Blobs:
    """Reads (and, for pack, writes) the blob store of one schema of a connection."""

    def __init__(self, conn: apsw.Connection, schema: str = "main") -> None:
        self.conn = conn
        self.schema = schema
        self.decompressors: dict[str | None, zstandard.ZstdDecompressor] = {}
        self.present: bool | None = None

    def decompressor(self, dict_hash: str | None) -> zstandard.ZstdDecompressor:
        if dict_hash not in self.decompressors:
            if dict_hash is None:
                self.decompressors[None] = zstandard.ZstdDecompressor()
            else:
                row = next(
                    iter(self.conn.execute(f"SELECT CAST(data AS BLOB) FROM {self.schema}.blob_dicts WHERE hash = ?", (dict_hash,))),
                    None,
                )
                if row is None:
                    raise BlobError(f"blob dictionary {dict_hash} is missing")
                self.decompressors[dict_hash] = zstandard.ZstdDecompressor(
                    dict_data=zstandard.ZstdCompressionDict(row[0])
                )
        return self.decompressors[dict_hash]

    def exists(self) -> bool:
        if self.present is None:
            self.present = is_packed(self.conn, self.schema)
        return self.present

    def payload(self, blob_hash: str) -> bytes:
        """The bytes stored under ``blob_hash``.

        :raises BlobError: the blob (or its dictionary) is missing, or does not decompress.
        """
        row = None
        if self.exists():
            row = next(
                iter(self.conn.execute(f"SELECT dict, CAST(data AS BLOB) FROM {self.schema}.blobs WHERE hash = ?", (blob_hash,))), None
            )
        if row is None:
            raise BlobError(f"blob {blob_hash} is missing")
        try:
            return self.decompressor(row[0]).decompress(row[1])
        except zstandard.ZstdError as exc:
            raise BlobError(f"blob {blob_hash} does not decompress: {exc}") from exc

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
        """Like ``resolve``, but a payload always comes back as its exact bytes."""
        if not isinstance(value, (bytes, str)) or not self.exists():
            return value  # a file with no blob store holds no references
        if holds == "text" and isinstance(value, bytes) and len(value) == MARKER_LENGTH and value.startswith(PREFIX.encode()):
            return self.payload(value[len(PREFIX) :].decode("ascii"))
        if holds == "blob" and isinstance(value, str) and len(value) == MARKER_LENGTH and value.startswith(PREFIX):
            return self.payload(value[len(PREFIX) :])
        return value


def register_functions(conn: apsw.Connection) -> None:
    """``dagsync_unpack(value, holds)`` and ``dagsync_unpack_src(...)``: a value with any
    blob reference resolved, from the main database or the attached ``src``."""
    for name, schema in (("dagsync_unpack", "main"), ("dagsync_unpack_src", "src")):
        store = Blobs(conn, schema)
        # Exact bytes: callers CAST them AS TEXT for a text column, byte for byte.
        conn.create_scalar_function(name, store.resolve_bytes, 2, deterministic=False)


def meta(conn: apsw.Connection, key: str) -> str | None:
    """A setting of the blob store (``_dagsync_meta``), or None."""
    if not bookkeeping.has(conn, "_dagsync_meta"):
        return None
    row = next(iter(conn.execute("SELECT value FROM _dagsync_meta WHERE key = ?", (key,))), None)
    return row[0] if row else None
