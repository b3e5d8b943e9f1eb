"""streamed: payloads too long to hold in memory, read and written in pieces.

A payload longer than ``packed.ONE_SHOT`` (8 MiB: a long document, an
attachment) never passes whole through Python. ``pack`` hashes it and
compresses it a piece at a time, reading the row through SQLite's incremental
blob I/O and writing the frame the same way; ``unpack`` decompresses a
frame into its row in pieces, proving it by its key on the way. Memory then
stays near ``STREAM_CHUNK`` whatever a payload holds (measured:
docs/blobs.md).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from typing import Any

import apsw
import zstandard

from dagsync.errors import BlobError
from dagsync.packed import ONE_SHOT, STREAM_CHUNK

__all__ = ["ONE_SHOT", "compress_into", "hash_of", "write_back"]


def _pieces(handle: apsw.Blob) -> Iterator[bytes]:
    while piece := handle.read(STREAM_CHUNK):
        yield piece


def hash_of(conn: apsw.Connection, table: str, column: str, rowid: int) -> str:
    """The sha256 (hex) of the bytes of ``main.table.column`` in row ``rowid``, read in pieces."""
    digest = hashlib.sha256()
    with conn.blob_open("main", table, column, rowid, False) as handle:
        for piece in _pieces(handle):
            digest.update(piece)
    return digest.hexdigest()


def compress_into(
    conn: apsw.Connection, table: str, column: str, rowid: int, blob_hash: str, level: int, *, write: bool
) -> int:
    """Compress the value of ``main.table.column`` in row ``rowid`` into one zstd frame
    (no dictionary: the value is long) and, with ``write``, store it as the blob
    ``blob_hash``. The frame goes through a temporary file, so neither it nor the
    value is ever held whole. Return the frame's length.

    :raises BlobError: the value changed under the hash (it is read twice).
    """
    with conn.blob_open("main", table, column, rowid, False) as handle:
        size = handle.length()
        with tempfile.TemporaryFile() as frame:
            digest = hashlib.sha256()
            writer = zstandard.ZstdCompressor(level=level, write_content_size=True).stream_writer(
                frame, size=size, closefd=False
            )
            for piece in _pieces(handle):
                digest.update(piece)
                writer.write(piece)
            writer.close()
            if digest.hexdigest() != blob_hash:
                raise BlobError(f"main.{table}.{column} of rowid {rowid} changed while it was packed; run pack again")
            stored = frame.tell()
            if write:
                frame.seek(0)
                conn.execute(
                    "INSERT INTO main.blobs (hash, size, dict, data) VALUES (?, ?, NULL, zeroblob(?))",
                    (blob_hash, size, stored),
                )
                with conn.blob_open("main", "blobs", "data", conn.last_insert_rowid(), True) as target:
                    while piece := frame.read(STREAM_CHUNK):
                        target.write(piece)
    return stored


def write_back(
    conn: apsw.Connection, table: str, column: str, rowid: int, kind: str, frame: Any,
    decompressor: zstandard.ZstdDecompressor, size: int,
) -> tuple[int, str]:
    """Put a payload of ``size`` bytes back into ``main.table.column`` of row ``rowid`` as
    ``kind`` (TEXT or BLOB), decompressing ``frame`` (bytes, or a blob handle) into it
    in pieces. Return how many bytes came out and their sha256 (hex), for the
    caller to prove against the blob's key before it commits; more than
    ``size`` stops at ``size + 1``. (A BLOB SQLite makes in place; a TEXT of
    that length it makes at once, in its own memory.)"""
    value = "zeroblob(?)" if kind == "BLOB" else "CAST(zeroblob(?) AS TEXT)"
    conn.execute(f'UPDATE main."{table}" SET "{column}" = {value} WHERE rowid = ?', (size, rowid))
    digest, written = hashlib.sha256(), 0
    with conn.blob_open("main", table, column, rowid, True) as handle:
        reader = decompressor.stream_reader(frame, read_size=STREAM_CHUNK)
        while piece := reader.read(STREAM_CHUNK):
            if written + len(piece) > size:
                return size + 1, ""
            handle.write(piece)
            digest.update(piece)
            written += len(piece)
    return written, digest.hexdigest()
