"""blobs: pack payloads into the content-addressed zstd store (``unpack.py`` puts them back).

System prompts, tool outputs and long documents repeat across thousands of
messages. ``pack`` stores each payload once, compressed, and leaves a short
reference in the row; ``unpack`` puts every payload back byte for byte so llm
can read the file again. What a packed file is, and how every command reads
one, is ``packed.py``.

Payloads shorter than the threshold stay inline: below it the reference and
the blob row cost more than they save (measured: docs/blobs.md).

Pack goes a chunk of rows at a time through the file's ``writer.Writer``:
each chunk hashes and compresses what the store lacks, writes the blobs and
rewrites the rows in one transaction (or step of a long one), so every
commit point is a consistent file, and packing again does only what is left.
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
from dagsync.backup import copy_database
from dagsync.db import THIN_CACHE_KIB, Database, open_target
from dagsync.errors import DagsyncError
from dagsync.formats import Format, PackedColumn
from dagsync.packed import (
    DDL,
    MARKER_LENGTH,
    ONE_SHOT,
    PREFIX,
    dict_ids,
    is_packed,
    marker_sql,
    meta,
    payload_bytes,
    reference_sql,
    sha256,
)
from dagsync.vacuum import VacuumReport
from dagsync.vacuum import vacuum as vacuum_file
from dagsync.writer import Writer

__all__ = ["PREFIX", "ColumnReport", "PackReport", "pack", "pack_new_rows"]

Progress = Callable[[str, int, int], None]

DEFAULT_LEVEL = 3
# Payloads this many bytes or longer go into blobs (see docs/blobs.md for the measurement).
DEFAULT_THRESHOLD = 192
# Payloads under this size are "small": a trained dictionary is used for them.
SMALL = 1024
DICT_SIZE = 112 * 1024
DICT_SAMPLES = 20_000
PACK_CACHE_KIB = THIN_CACHE_KIB
# ``_dagsync_meta`` keys ``pack_through:<table>.<column>``: the highest rowid
# whose value a pack or a merge into the packed file has looked at.
THROUGH = "pack_through:"


# -- pack ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ColumnReport:
    table: str
    column: str
    packed: int  # values moved into blobs by this run
    payload_bytes: int  # their bytes
    inline: int  # values left inline: shorter than the threshold


@dataclass(frozen=True)
class PackReport:
    path: str
    format: str
    dry_run: bool
    level: int
    threshold: int
    dictionary: str | None  # the hash of the dictionary used for small payloads
    columns: tuple[ColumnReport, ...]
    payload_bytes: int  # bytes of the values packed by this run
    distinct_payloads: int  # distinct payloads among them
    distinct_bytes: int  # their bytes
    new_blobs: int  # blobs written (the rest were in the store already)
    stored_bytes: int  # compressed bytes of the new blobs
    dedup_ratio: float  # payload_bytes / distinct_bytes
    compression_ratio: float  # bytes of the new blobs' payloads / stored_bytes
    file_bytes_before: int
    file_bytes_after: int
    vacuum: VacuumReport | None
    seconds: float
    grew: str | None = None  # why the file is larger than before, if it is
    # Full-text indexes over packed columns this run dropped (or would): unpack makes them again (fts).
    dropped_indexes: tuple[str, ...] = ()


@faults.named("path")
def pack(
    path: str | os.PathLike[str],
    *,
    dictionary: bool = False,
    level: int | None = None,
    threshold: int | None = None,
    dry_run: bool = False,
    vacuum: bool = False,
    progress: Progress | None = None,
    output: str | os.PathLike[str] | None = None,
) -> PackReport:
    """Move payloads of ``path`` at least ``threshold`` bytes long into the blob store.

    With ``output``, ``path`` is only read: a consistent copy of it is made
    as the new file ``output`` (``db.copy_database``), and the copy is packed.

    Packing again packs only what is still inline (new rows). ``dictionary``
    trains a zstd dictionary from a sample of the file's own small payloads
    and uses it for small ones from then on; ``level`` is the zstd level.
    Settings are remembered in the file for later runs (and for merges into
    it). With ``dry_run`` nothing is written: the report says what a real
    run would do.

    :raises DagsyncError: an invalid level or threshold.
    """
    started = time.perf_counter()
    if output is not None and not dry_run:
        copy_database(path, output)
        path = output
    db = open_target(path, check=True)
    try:
        # Pack reads and rewrites rows in order, a chunk at a time: half the
        # page cache a merge takes is as fast, and keeps its quick_check and a
        # --vacuum from holding 64 MiB of pages (peak RSS: docs/blobs.md).
        db.conn.execute(f"PRAGMA cache_size = -{PACK_CACHE_KIB}")
        before = os.path.getsize(path)
        writer = Writer(db.conn, progress, dry_run=dry_run)
        run = _Pack(db, writer)
        run.settings(dictionary, level, threshold)
        columns = run.columns()
        # Each column again from where it is, if a long transaction had to give way.
        writer.redo(functools.partial(run.pack_all, columns), "packing it")
        reports = tuple(run.column_report(c) for c in columns)
        run.drop_temp()
        vacuumed = vacuum_file(db, progress) if vacuum and not dry_run else None
        payload = sum(c.payload_bytes for c in reports)
        after = os.path.getsize(path)
        return PackReport(
            path=str(path),
            format=db.format.name,
            dry_run=dry_run,
            level=run.level,
            threshold=run.threshold,
            dictionary=run.dict_hash,
            columns=reports,
            payload_bytes=payload,
            distinct_payloads=run.distinct,
            distinct_bytes=run.distinct_bytes,
            new_blobs=run.new_blobs,
            stored_bytes=run.stored_bytes,
            dedup_ratio=round(payload / run.distinct_bytes, 3) if run.distinct_bytes else 1.0,
            compression_ratio=round(run.new_payload_bytes / run.stored_bytes, 3) if run.stored_bytes else 1.0,
            file_bytes_before=before,
            file_bytes_after=after,
            vacuum=vacuumed,
            seconds=round(time.perf_counter() - started, 3),
            grew=_why_larger(after - before, sum(c.packed for c in reports), vacuumed is not None),
            dropped_indexes=tuple(run.dropped_indexes),
        )
    finally:
        db.close()


def _through_key(column: PackedColumn) -> str:
    return f"{THROUGH}{column.table}.{column.column}"


def _why_larger(growth: int, packed: int, vacuumed: bool) -> str | None:
    if growth <= 0:
        return None
    why = (
        f"the file grew by {growth:,} bytes: the blob store's tables and index take pages of their own, "
        f"more than packing {packed:,} payload(s) gave back"
    )
    if not vacuumed:
        why += "; --vacuum returns the pages the packed rows freed"
    return why + " (packing pays off on files with long or repeated payloads)"


def pack_new_rows(db: Database, writer: Writer, source_schema: str | None = None) -> None:
    """Pack what is inline in an already-packed database, with its own settings (after a merge).

    With ``source_schema`` (an attached packed source), a payload whose blob
    the source has is not compressed again: the blob and its dictionary are
    copied by key. Its chunks go through ``writer``, the caller's.
    """
    run = _Pack(db, writer)
    run.source = source_schema
    run.settings(False, None, None)
    for column in run.columns():
        # Only rows past where the last pack or merge looked (``THROUGH``): what
        # a merge brings gets rowids after the highest, so a nightly merge into
        # a packed archive does not read the whole history for what is new.
        run.pack_column(column, since=int(meta(db.conn, _through_key(column)) or 0))
    run.note_through()
    run.drop_temp()


class _Pack:
    """One pack of one file: its settings, its compressors, and what it has done."""

    def __init__(self, db: Database, writer: Writer) -> None:
        self.db = db
        self.conn = db.conn
        self.fmt: Format = db.format
        self.writer = writer
        self.dry_run = writer.dry_run
        self.distinct = self.distinct_bytes = self.new_blobs = self.stored_bytes = self.new_payload_bytes = 0
        self.packed: dict[tuple[str, str], list[int]] = {}  # (table, column) -> [values, bytes], committed
        self.compressors: dict[bool, zstandard.ZstdCompressor] = {}
        self.dict_hash: str | None = None
        self.dict_key: int | str | None = None  # what a blob's ``dict`` says for it: its id (its hash in the first store)
        self.dict_data: bytes | None = None
        self.source: str | None = None
        self.dropped_indexes: list[str] = []
        self.through: dict[str, int] = {}  # THROUGH key -> rowid looked at up to, to be noted
        # Whether a payload packed may have had its blob before this run (``temp.pack_seen``
        # counts the distinct ones); if not, the run's new blobs are its distinct payloads.
        self.seen_before: bool | None = None

    def columns(self) -> list[PackedColumn]:
        present = {n for (n,) in self.conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        return [c for c in self.fmt.packed if c.table in present]

    def settings(self, dictionary: bool, level: int | None, threshold: int | None) -> None:
        stored_level, stored_threshold = meta(self.conn, "pack_level"), meta(self.conn, "pack_threshold")
        self.level = level if level is not None else int(stored_level or DEFAULT_LEVEL)
        self.threshold = threshold if threshold is not None else int(stored_threshold or DEFAULT_THRESHOLD)
        if not 1 <= self.level <= 22:
            raise DagsyncError(f"invalid zstd level {self.level}: give a level from 1 (fastest) to 22 (smallest)")
        if self.threshold < MARKER_LENGTH + 1:
            raise DagsyncError(
                f"invalid threshold {self.threshold}: payloads shorter than a reference "
                f"({MARKER_LENGTH} bytes) cannot be packed; give {MARKER_LENGTH + 1} or more"
            )
        stored_dict = meta(self.conn, "pack_dict") or None
        trained = _train(self.conn, self.columns(), self.threshold, self.level, self.writer) if dictionary else None
        if trained:
            self.dict_data, self.dict_hash = trained, sha256(trained)
        elif stored_dict:
            # Without --dict, or with too few inline small payloads left to
            # learn from, keep using the dictionary the file already has.
            self.dict_hash = stored_dict
            self.dict_data = next(iter(self.conn.execute("SELECT data FROM blob_dicts WHERE hash = ?", (stored_dict,))))[0]
        if not is_packed(self.conn):
            _refuse_lookalikes(self.conn, self.columns())
        self.conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS pack_chunk (rid INTEGER PRIMARY KEY, h TEXT NOT NULL, size INTEGER NOT NULL);"
            "CREATE TEMP TABLE IF NOT EXISTS pack_dry (hash TEXT PRIMARY KEY);"
            "CREATE TEMP TABLE IF NOT EXISTS pack_seen (hash TEXT PRIMARY KEY, size INTEGER);"
            "CREATE TEMP TABLE IF NOT EXISTS pack_new (hash TEXT PRIMARY KEY, size INTEGER, dict, data BLOB);"
        )
        self.conn.create_scalar_function("dagsync_sha256", sha256, 1, deterministic=True)
        self.conn.create_scalar_function("dagsync_compress", self.compress, 1, deterministic=True)
        # An index its triggers keep over a packed column would index references (fts).
        self.dropped_indexes = [n for n in fts.over_packed(self.fmt, self.columns()) if bookkeeping.has(self.conn, n)]
        self.dict_key = self.dict_hash
        if self.dry_run:
            return
        wanted = {"pack_level": str(self.level), "pack_threshold": str(self.threshold), "pack_dict": self.dict_hash or ""}
        if is_packed(self.conn) and all(meta(self.conn, k) == v for k, v in wanted.items()) and not self.dropped_indexes:
            self.name_dictionary()
            return  # packed already, with these settings: nothing to write
        with self.writer.transaction():
            bookkeeping.ensure(self.conn)
            for name in self.dropped_indexes:
                fts.drop(self.conn, self.fmt, name)
            self.conn.execute(DDL)
            if self.dict_data:
                self.conn.execute("INSERT OR IGNORE INTO blob_dicts (hash, data) VALUES (?, ?)", (self.dict_hash, self.dict_data))
            self.conn.executemany("INSERT OR REPLACE INTO _dagsync_meta (key, value) VALUES (?, ?)", wanted.items())
        self.name_dictionary()

    def name_dictionary(self) -> None:
        """``dict_key``: how the blobs this run writes name their dictionary."""
        if self.dict_hash is not None and dict_ids(self.conn):
            self.dict_key = self.writer.one("SELECT id FROM main.blob_dicts WHERE hash = ?", (self.dict_hash,))

    def compress(self, value: str | bytes) -> bytes:
        data = payload_bytes(value)
        small = self.dict_data is not None and len(data) < SMALL
        if small not in self.compressors:
            self.compressors[small] = zstandard.ZstdCompressor(
                level=self.level,
                dict_data=zstandard.ZstdCompressionDict(self.dict_data) if small else None,
                write_content_size=True,
            )
        return self.compressors[small].compress(data)

    def pack_column(self, column: PackedColumn, since: int = 0) -> None:
        """Pack the column's inline payloads in rows past rowid ``since``, a chunk
        of rows per transaction; then note how far it looked (``THROUGH``)."""
        table, value = f'main."{column.table}"', f't."{column.column}"'
        # octet_length: the bytes of a value without reading it (a long one is streamed).
        packable = f"typeof({value}) = '{column.holds}' AND octet_length({value}) >= {self.threshold}"
        in_memory = f"octet_length({value}) <= {ONE_SHOT}"
        marker = reference_sql(column, "k.h")
        small = f"length(CAST({value} AS BLOB)) < {SMALL}"
        dict_value = f"CASE WHEN {small} THEN ? END" if self.dict_hash else "NULL"
        dict_params = (self.dict_key,) if self.dict_hash else ()
        tally = self.packed.setdefault((column.table, column.column), [0, 0])
        phase = f"pack: {column.table}.{column.column}"
        through = self.writer.one(f"SELECT coalesce(max(rowid), 0) FROM {table}")
        past = f"rowid > {int(since)}" if since else "1"
        for low, high in self.writer.ranges(table, where=past, phase=phase, writes=True):
            with self.writer.transaction():
                self.conn.execute("DELETE FROM temp.pack_chunk")
                self.conn.execute(
                    f"INSERT INTO temp.pack_chunk SELECT t.rowid, dagsync_sha256(CAST({value} AS BLOB)), length(CAST({value} AS BLOB)) "
                    f"FROM {table} t WHERE t.rowid BETWEEN ? AND ? AND {packable} AND {in_memory}",
                    (low, high),
                )
                for rid, size in self.conn.execute(
                    f"SELECT t.rowid, octet_length({value}) FROM {table} t "
                    f"WHERE t.rowid BETWEEN ? AND ? AND {packable} AND NOT {in_memory}",
                    (low, high),
                ).fetchall():  # a long payload: hashed in pieces (streamed)
                    self.conn.execute(
                        "INSERT INTO temp.pack_chunk VALUES (?, ?, ?)",
                        (rid, streamed.hash_of(self.conn, column.table, column.column, rid), size),
                    )
                # Counted from the chunk table: the rows themselves are read once more only
                # for the payloads the store lacks, and written once.
                n, size = next(iter(self.conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM temp.pack_chunk")))
                if self.seen_before is None:
                    self.seen_before = bool(self.source) or (
                        is_packed(self.conn) and self.writer.one("SELECT 1 FROM main.blobs LIMIT 1") is not None
                    )
                if self.seen_before:
                    self.conn.execute("INSERT OR IGNORE INTO temp.pack_seen SELECT h, size FROM temp.pack_chunk")
                if self.source and not self.dry_run:
                    _copy_blobs(self.conn, self.source)
                # One blob per payload this chunk brings that the store lacks,
                # compressed into a temp table and counted there.
                lacking = "k.h NOT IN (SELECT hash FROM temp.pack_dry)" + (
                    " AND k.h NOT IN (SELECT hash FROM main.blobs)" if is_packed(self.conn) else ""
                )
                self.conn.execute(
                    f"INSERT INTO temp.pack_new SELECT n.h, length(CAST({value} AS BLOB)), {dict_value}, "
                    f"dagsync_compress(CAST({value} AS BLOB)) FROM (SELECT k.h, min(k.rid) AS rid FROM temp.pack_chunk k "
                    f"WHERE {lacking} AND k.size <= {ONE_SHOT} GROUP BY k.h) n JOIN {table} t ON t.rowid = n.rid",
                    dict_params,
                )
                made, made_size, stored = next(iter(self.conn.execute(
                    "SELECT count(*), coalesce(sum(size), 0), coalesce(sum(length(data)), 0) FROM temp.pack_new"
                )))  # fmt: skip
                for blob_hash, rid, size in self.conn.execute(
                    f"SELECT k.h, min(k.rid), k.size FROM temp.pack_chunk k WHERE {lacking} AND k.size > {ONE_SHOT} GROUP BY k.h"
                ).fetchall():  # a long payload: compressed in pieces, its frame written in pieces
                    made, made_size = made + 1, made_size + size
                    stored += streamed.compress_into(
                        self.conn, column.table, column.column, rid, blob_hash, self.level, write=not self.dry_run
                    )
                    if self.dry_run:
                        self.conn.execute("INSERT INTO temp.pack_dry VALUES (?)", (blob_hash,))
                self.writer.on_commit(functools.partial(self.count, tally, n, size, made, made_size, stored))
                if self.dry_run:
                    self.conn.execute("INSERT INTO temp.pack_dry SELECT hash FROM temp.pack_new")
                elif n:
                    self.conn.execute(
                        "INSERT INTO _dagsync_meta (key, value) VALUES ('pack_generation', '1') "
                        "ON CONFLICT (key) DO UPDATE SET value = CAST(value AS INTEGER) + 1"
                    )
                    self.conn.execute("INSERT INTO main.blobs (hash, size, dict, data) SELECT * FROM temp.pack_new")
                    self.conn.execute(
                        f'UPDATE {table} AS t SET "{column.column}" = {marker} FROM temp.pack_chunk k WHERE t.rowid = k.rid'
                    )
                self.conn.execute("DELETE FROM temp.pack_new")
        if through > since:
            # Rows inserted since ``through`` was read lie past it: the next run looks at them.
            self.through[_through_key(column)] = through

    def pack_all(self, columns: list[PackedColumn]) -> None:
        for column in columns:
            self.pack_column(column)
        self.note_through()

    def note_through(self) -> None:
        """Record how far each column was looked at (``THROUGH``), in one transaction."""
        moved = [(k, str(v)) for k, v in self.through.items() if meta(self.conn, k) != str(v)]
        if self.dry_run or not moved:
            return  # nothing to write: a pack with nothing to do leaves the file as it was
        with self.writer.transaction():
            self.conn.executemany("INSERT OR REPLACE INTO _dagsync_meta (key, value) VALUES (?, ?)", moved)

    def count(self, tally: list[int], n: int, size: int, made: int, made_size: int, stored: int) -> None:
        """What one committed chunk did."""
        tally[0] += n
        tally[1] += size
        self.new_blobs += made
        self.new_payload_bytes += made_size
        self.stored_bytes += stored

    def column_report(self, column: PackedColumn) -> ColumnReport:
        packed, payload = self.packed.get((column.table, column.column), (0, 0))
        value = f'"{column.column}"'
        inline = next(iter(self.conn.execute(
            f'SELECT count(*) FROM main."{column.table}" WHERE typeof({value}) = \'{column.holds}\' '
            f"AND length(CAST({value} AS BLOB)) < {self.threshold}"
        )))[0]  # fmt: skip
        return ColumnReport(column.table, column.column, packed, payload, inline)

    def drop_temp(self) -> None:
        if self.seen_before:
            self.distinct, self.distinct_bytes = next(
                iter(self.conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM temp.pack_seen"))
            )
        else:  # every payload packed had its blob made by this run, once
            self.distinct, self.distinct_bytes = self.new_blobs, self.new_payload_bytes
        for name in ("pack_chunk", "pack_dry", "pack_seen", "pack_new"):
            self.conn.execute(f"DROP TABLE IF EXISTS temp.{name}")


def _refuse_lookalikes(conn: apsw.Connection, columns: list[PackedColumn]) -> None:
    """Before a file's first pack: no value may already read like a reference.

    In a packed file such a value would be taken for one. llm never
    writes them (they are stored with the storage class it does not use
    in that column), so one means a hand-made or damaged row.

    :raises DagsyncError: naming the first such value.
    """
    for column in columns:
        row = next(
            iter(conn.execute(f'SELECT t.rowid FROM "{column.table}" t WHERE {marker_sql(column, "t")} LIMIT 1')),
            None,
        )
        if row is not None:
            kind = "a BLOB" if column.holds == "text" else "TEXT"
            raise DagsyncError(
                f"{column.table}.{column.column} of rowid {row[0]} is {kind} that reads like a blob reference "
                f"('{PREFIX}' and a hash); a packed file would take it for one, so pack refuses: "
                "change or remove that value first"
            )


def _train(conn: apsw.Connection, columns: list[PackedColumn], threshold: int, level: int, writer: Writer) -> bytes | None:
    """A dictionary trained on an even sample of the file's small payloads (None if too few)."""
    samples: list[bytes] = []
    for column in columns:
        value = f'"{column.column}"'
        total = next(iter(conn.execute(f'SELECT max(rowid) FROM "{column.table}"')))[0] or 0
        step = max(1, total // DICT_SAMPLES)
        samples += [
            payload_bytes(v)
            for (v,) in conn.execute(
                f'SELECT {value} FROM "{column.table}" WHERE rowid % ? = 0 AND typeof({value}) = ? '
                f"AND length(CAST({value} AS BLOB)) BETWEEN ? AND ? LIMIT ?",
                (step, column.holds, threshold, SMALL - 1, DICT_SAMPLES),
            )
        ]
    if len(samples) < 100:
        return None
    writer.progress("pack: training a dictionary", 0, 1)
    return zstandard.train_dictionary(DICT_SIZE, samples, level=level).as_bytes()


def _copy_blobs(conn: apsw.Connection, src: str) -> None:
    """Copy by key from the attached packed source ``src`` the blobs (and their
    dictionaries) of the payloads in ``temp.pack_chunk``: none is compressed again."""
    # A dictionary is copied by its hash; each file names it its own way.
    src_key = "id" if dict_ids(conn, src) else "hash"
    src_hash = "b.dict" if src_key == "hash" else f"(SELECT d.hash FROM {src}.blob_dicts d WHERE d.id = b.dict)"
    dict_of = f"(SELECT m.id FROM main.blob_dicts m WHERE m.hash = {src_hash})" if dict_ids(conn) else src_hash
    conn.execute(
        f"INSERT OR IGNORE INTO main.blob_dicts (hash, data) SELECT d.hash, d.data FROM {src}.blob_dicts d "
        f"WHERE d.{src_key} IN (SELECT b.dict FROM {src}.blobs b WHERE b.hash IN (SELECT h FROM temp.pack_chunk))"
    )
    conn.execute(
        f"INSERT OR IGNORE INTO main.blobs (hash, size, dict, data) SELECT b.hash, b.size, {dict_of}, b.data "
        f"FROM {src}.blobs b WHERE b.hash IN (SELECT h FROM temp.pack_chunk)"
    )
