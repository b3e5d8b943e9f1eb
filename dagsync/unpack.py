"""unpack: put every packed payload back inline, byte for byte, and remove the blob store.

Afterwards the file is an ordinary llm database again (``pack``, in
``blobs.py``, is the other direction; ``packed.py`` says what a packed file
is). Nothing is written before every blob a packed value refers to is
proven by its key and size (``_prove_references``): a damaged store leaves
the file exactly as it was. Then each column is rewritten a chunk of rows
at a time through the file's ``writer.Writer``, each row's payload taken
from a join with the store and proven again as it is written; the store is
dropped only when no reference is left.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import apsw
import zstandard

from dagsync import bookkeeping, faults, fts, streamed
from dagsync.db import THIN_CACHE_KIB, Database, open_target
from dagsync.errors import BlobError, DagsyncError
from dagsync.formats import PackedColumn
from dagsync.packed import (
    ONE_SHOT,
    Blobs,
    blob_hash_sql,
    damaged,
    frame_sql,
    is_packed,
    lost_store,
    lost_store_error,
    marker_sql,
    proof,
    reference_values,
    register_functions,
)
from dagsync.vacuum import VacuumReport
from dagsync.vacuum import vacuum as vacuum_file
from dagsync.writer import Writer

__all__ = ["UnpackReport", "unpack"]

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class UnpackReport:
    path: str
    format: str
    dry_run: bool
    values: int  # references replaced by their payloads
    payload_bytes: int  # bytes put back inline
    blobs_removed: int
    file_bytes_before: int
    file_bytes_after: int
    vacuum: VacuumReport | None
    seconds: float
    # Full-text indexes pack had dropped, made again and filled (or that would be: fts).
    rebuilt_indexes: tuple[str, ...] = ()


@faults.named("path")
def unpack(
    path: str | os.PathLike[str], *, dry_run: bool = False, vacuum: bool = False, progress: Progress | None = None
) -> UnpackReport:
    """Put every packed payload of ``path`` back inline, byte for byte, and remove the blob store.

    Afterwards the file is an ordinary llm database again. A file that is not
    packed is left as it is.
    """
    started = time.perf_counter()
    db = open_target(path, check=True)
    conn = db.conn
    # As pack (blobs.PACK_CACHE_KIB): rows rewritten in order need no more, and a
    # long payload's pages then cost no more than that (docs/blobs.md).
    conn.execute(f"PRAGMA cache_size = -{THIN_CACHE_KIB}")
    try:
        before = os.path.getsize(path)
        writer = Writer(conn, progress, dry_run=dry_run)
        done = [0, 0]  # values, bytes: committed
        blobs = 0
        rebuilt: list[str] = []
        present = {n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        columns = [c for c in db.format.packed if c.table in present]
        if not is_packed(conn):
            _refuse_a_lost_store(db)
        else:
            register_functions(conn)
            # Every blob a packed value refers to proven first, so that a damaged
            # one leaves the file as it was: unpack writes nothing, or all.
            _prove_references(writer, db, columns)
            writer.redo(lambda: [_unpack_column(writer, c, done) for c in columns], "unpacking it")
            blobs = next(iter(conn.execute("SELECT count(*) FROM blobs")))[0]
            rebuilt = fts.dropped(conn)
            if not dry_run:
                # Once every payload is back: the store goes only after, so a
                # run cut short here is still a packed file that unpack finishes.
                for name in rebuilt:
                    writer.redo(functools.partial(fts.restore, writer, db.format, name), "indexing it")
                with writer.transaction():
                    # Rows written meanwhile by a merge into this packed file are
                    # packed too: only drop the store when nothing refers to it.
                    for column in columns:
                        if any(conn.execute(f'SELECT 1 FROM "{column.table}" t WHERE {marker_sql(column, "t")} LIMIT 1')):
                            raise DagsyncError(f"{path} gained packed rows while unpacking; run unpack again")
                    conn.execute("DROP TABLE blobs; DROP TABLE blob_dicts")
                    bookkeeping.rewritten(conn, "unpack")
                    conn.execute(
                        "DELETE FROM _dagsync_meta WHERE key IN ('pack_level', 'pack_threshold', 'pack_dict', ?) "
                        "OR key LIKE 'pack\\_through:%' ESCAPE '\\'", (fts.DROPPED,)
                    )
        vacuumed = vacuum_file(db, progress) if vacuum and not dry_run else None
        return UnpackReport(
            str(path), db.format.name, dry_run, done[0], done[1], blobs, before, os.path.getsize(path), vacuumed,
            round(time.perf_counter() - started, 3), tuple(rebuilt),
        )  # fmt: skip
    finally:
        db.close()


def _refuse_a_lost_store(db: Database) -> None:
    """A file that was packed and has lost its blob store cannot be unpacked.

    (A file never packed holds no references: a value that reads like one is
    just a value, which pack refuses to pack.)

    :raises BlobError: naming the file.
    """
    if lost_store(db.conn):
        raise lost_store_error(str(db.path))


def _prove_references(writer: Writer, db: Database, columns: list[PackedColumn]) -> None:
    """Prove every blob a packed value of the file refers to, before anything is written.

    The store is read in file order, every blob proven (a damaged one that
    nothing refers to is left for gc: unpack drops the store anyway); then
    each column is searched for a value whose blob is missing.

    :raises BlobError: naming the first blob that fails, or is missing.
    """
    conn, store = db.conn, Blobs(db.conn)
    for low, high in writer.ranges("main.blobs"):
        for rowid, blob_hash, dict_key, frame, size in conn.execute(
            f"SELECT {frame_sql('b')} FROM main.blobs b WHERE b.rowid BETWEEN ? AND ?", (low, high)
        ):
            try:
                problem = store.problem_in_row(rowid, blob_hash, dict_key, frame, size)
            except BlobError as exc:  # its dictionary is missing
                problem = f"cannot be read ({exc})"
            if problem is not None and _referred_to(writer, columns, blob_hash):
                raise damaged(str(db.path), blob_hash, problem)
    for column in columns:
        ref = blob_hash_sql(column, "t")
        for low, high in writer.ranges(f'main."{column.table}"'):
            for (missing,) in conn.execute(
                f'SELECT {ref} FROM main."{column.table}" t WHERE t.rowid BETWEEN ? AND ? AND {marker_sql(column, "t")} '
                f"AND NOT EXISTS (SELECT 1 FROM main.blobs b WHERE b.hash = {ref}) LIMIT 1",
                (low, high),
            ):
                raise damaged(str(db.path), missing, "is missing")


def _referred_to(writer: Writer, columns: list[PackedColumn], blob_hash: str) -> bool:
    """Whether a packed value refers to ``blob_hash`` (asked only of a damaged blob)."""
    short, first, as_text = reference_values(blob_hash)
    for column in columns:
        values = (short, first) if column.holds == "text" else (as_text, as_text)
        for low, high in writer.ranges(f'main."{column.table}"'):
            if writer.one(
                f'SELECT 1 FROM main."{column.table}" WHERE rowid BETWEEN ? AND ? AND "{column.column}" IN (?, ?) LIMIT 1',
                (low, high, *values),
            ):
                return True
    return False


def _unpack_column(writer: Writer, column: PackedColumn, done: list[int]) -> None:
    """Put one column's payloads back, a chunk of rows per transaction; count what is committed.

    The store is joined, not looked up a value at a time; each payload is
    proven again as it is written (``dagsync_blob``), and counted by its size.
    """
    conn = writer.conn
    table = f'main."{column.table}"'
    kind = "TEXT" if column.holds == "text" else "BLOB"
    its_blob = f"b.hash = {blob_hash_sql(column, 't')}"
    for low, high in writer.ranges(table, phase=f"unpack: {column.table}.{column.column}", writes=True):
        where = f"t.rowid BETWEEN {int(low)} AND {int(high)} AND {marker_sql(column, 't')}"
        with writer.transaction():
            n, size = next(iter(conn.execute(
                f"SELECT count(*), coalesce(sum(b.size), 0) FROM {table} t JOIN main.blobs b ON {its_blob} WHERE {where}"
            )))  # fmt: skip
            if n and not writer.dry_run:
                conn.execute(
                    f'UPDATE {table} AS t SET "{column.column}" = CAST(dagsync_blob(b.hash, b.dict, b.data, b.size) '
                    f"AS {kind}) FROM main.blobs b WHERE {its_blob} AND {where} AND b.size <= {ONE_SHOT}"
                )
                for row in conn.execute(
                    f"SELECT t.rowid, b.rowid, b.hash, b.dict, b.size FROM {table} t JOIN main.blobs b ON {its_blob} "
                    f"WHERE {where} AND b.size > {ONE_SHOT}"
                ).fetchall():  # a long payload: decompressed into its row in pieces
                    _write_back(conn, column, kind, *row)
            writer.on_commit(functools.partial(_count, done, n, size))


def _write_back(
    conn: apsw.Connection, column: PackedColumn, kind: str, rowid: int, blob_rowid: int, blob_hash: str,
    dict_key: int | str | None, size: int,
) -> None:
    """Put one long payload back into its row, proven by its key before the transaction commits.

    :raises BlobError: what came out is not the payload its key names (the transaction rolls back).
    """
    store = Blobs(conn)
    with conn.blob_open("main", "blobs", "data", blob_rowid, False) as frame:
        try:
            length, digest = streamed.write_back(
                conn, column.table, column.column, rowid, kind, frame, store.decompressor(dict_key), size
            )
        except zstandard.ZstdError as exc:
            raise store.damaged(blob_hash, f"does not decompress ({exc})") from None
    problem = proof(blob_hash, size, length, digest)
    if problem is not None:
        raise store.damaged(blob_hash, problem)


def _count(done: list[int], values: int, size: int) -> None:
    done[0] += values
    done[1] += size
