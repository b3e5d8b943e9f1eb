"""Rows proven by their own keys before a merge writes anything.

A source is untrusted: a row is copied only once what its key stands for is
checked, in the plan, so that a row that fails is named and nothing at all
is written. Only rows that are copied are proven: a re-merge that copies
nothing hashes nothing. What is proven:

* **messages.** Every message the plan copies is re-hashed from the
  source's rows (``rehash``): a dag message's role, metadata and parts must
  hash to its ``content_hash`` by the spec's contract, an llm message's
  parent, role and parts (fragments and attachments resolved) to its key by
  llm's recipe. The hashing runs in a thread on its own connection to the
  source (``MessageProofs``), started when the messages are planned, while
  the rest of the plan goes on: SQLite's work runs without the GIL, so the
  two share both cores. The copy waits for its verdict.
* **packed values.** A packed source's rows hold references to its blob
  store, and a packed target gets those blobs copied by key. Every blob a
  copied row refers to is read in bounded pieces and must hash to its key
  and have the size its row records (``packed.Blobs.problem``); a frame that
  claims more than that - a decompression bomb - is refused unread. A source
  that was packed and has lost its store is refused whole.

"""

from __future__ import annotations

import shutil
import tempfile
import threading
import urllib.parse
from pathlib import Path

import apsw

from dagsync import others
from dagsync.db import harden
from dagsync.transactions import BUSY_TIMEOUT_MS
from dagsync.errors import DagsyncError, DamagedSource
from dagsync.formats import Key, KeyProof
from dagsync.merge.core import MAX_CONFLICTS_SHOWN, SourceMerge
from dagsync.merge.references import is_new
from dagsync.packed import (
    Blobs,
    blob_hash_sql,
    lost_store,
    lost_store_error,
    marker_sql,
    prove_referenced,
)
from dagsync.rehash import (
    DAG_COLUMNS,
    LLM_COLUMNS,
    LlmLookups,
    dag_failures,
    key_sql,
    llm_failures,
    register_key_recipes,
)

__all__ = ["MessageProofs", "prove"]


class MessageProofs:
    """The messages a merge will copy (``temp.msg_new``), re-hashed in a thread.

    The thread cannot see the merge connection's temp tables, so the keys to
    prove are handed over in a scratch file (a temp directory, deleted after),
    in copy order; the thread reads each message with its parts from the
    source by key, on its own read-only connection, and stops at the first
    that fails. ``wait`` gives the verdict.
    """

    def __init__(self, run: SourceMerge, key: Key) -> None:
        self.source = run.source
        self.file = run.file  # what is copied: the source, or its delta or bundle
        # A thin file's messages may refer to attachments only the target holds.
        self.target = run.db.path if run.thin else None
        self.key = key
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._scratch = Path(tempfile.mkdtemp(prefix="dagsync-proofs-"))
        keys = self._scratch / "keys.db"
        c = run.conn
        c.execute("ATTACH DATABASE ? AS proof", (str(keys),))
        try:
            c.execute("PRAGMA proof.journal_mode = OFF")
            c.execute("PRAGMA proof.synchronous = OFF")
            c.execute("CREATE TABLE proof.keys (seq INTEGER PRIMARY KEY, key TEXT NOT NULL, rid INTEGER NOT NULL)")
            c.execute("INSERT INTO proof.keys SELECT seq, src, rid FROM temp.msg_new ORDER BY seq")
        finally:
            c.execute("DETACH DATABASE proof")
        self._thread = threading.Thread(target=self._run, args=(keys,), name="message proofs", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, run: SourceMerge, key: Key) -> MessageProofs | None:
        """Prove the messages the plan copies, if it copies any."""
        if not run.one("SELECT 1 FROM temp.msg_new LIMIT 1"):
            return None
        return cls(run, key)

    def _run(self, keys: Path) -> None:
        try:
            conn = apsw.Connection(str(self.file), flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI)
            try:
                harden(conn)
                conn.setbusytimeout(BUSY_TIMEOUT_MS)
                conn.execute("ATTACH DATABASE ? AS proof", (str(keys),))
                if self.target is not None:
                    uri = "file:" + urllib.parse.quote(str(Path(self.target).resolve())) + "?mode=ro"
                    with others.own_open(str(self.target)):  # nobody waiting for the merge's locks
                        conn.execute("ATTACH DATABASE ? AS target", (uri,))
                self._prove(conn)
            finally:
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), in the merge thread
            self.failure = exc

    def _prove(self, conn: apsw.Connection) -> None:
        blobs = Blobs(conn)
        if self.key is Key.DAG_MESSAGE:
            rows = conn.execute(
                f"SELECT {DAG_COLUMNS} FROM proof.keys k JOIN main.messages m ON m.rowid = k.rid AND +m.id = k.key "
                'LEFT JOIN main.message_parts p ON p.message_id = m.id ORDER BY k.seq, p."order"'
            )
            failures = dag_failures(self._until_stopped(rows), blobs, blob_errors=True)
        else:
            rows = conn.execute(
                f"SELECT {LLM_COLUMNS} FROM proof.keys k JOIN main.messages m ON m.rowid = k.rid AND +m.hash = k.key "
                "LEFT JOIN main.parts p ON p.message_hash = m.hash ORDER BY k.seq, p.position"
            )
            lookups = LlmLookups(conn, blobs, also="target" if self.target is not None else None)
            failures = llm_failures(self._until_stopped(rows), lookups, blob_errors=True)
        for key, what in failures:
            self.failure = DamagedSource(
                f"{self.source}: message {key} does not match its key: {what}; it was not copied, "
                f"and nothing was merged - run `dagsync verify {self.source}` to see every damaged row, "
                "and restore the source from a backup"
            )
            return

    def _until_stopped(self, rows):
        for row in rows:
            if self._stop.is_set():
                return
            yield row

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether every message is proven (waiting up to ``timeout`` seconds for it).

        :raises DamagedSource: as ``wait``.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self.wait()
        return True

    def wait(self) -> None:
        """Block until every message is proven.

        :raises DamagedSource: naming the first message that does not hash to its key.
        """
        self._thread.join()
        shutil.rmtree(self._scratch, ignore_errors=True)
        if isinstance(self.failure, DagsyncError):
            raise self.failure
        if isinstance(self.failure, apsw.Error):
            raise DamagedSource(
                f"{self.source} cannot be read to prove the messages it holds: {self.failure}; "
                f"nothing was merged - run `dagsync verify {self.source}`"
            ) from self.failure
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        """Stop proving (the merge failed for another reason) and clean up."""
        self._stop.set()
        self._thread.join()
        shutil.rmtree(self._scratch, ignore_errors=True)


def prove(run: SourceMerge) -> None:
    """Prove the blobs and the hash-keyed rows the plan copies.

    :raises BlobError: naming the first blob a copied row refers to that fails its proof.
    :raises DamagedSource: naming the first copied row whose content does not give its key.
    """
    if not run.source_packed:
        if lost_store(run.conn, "src"):
            raise lost_store_error(str(run.source))
    else:
        _prove_references(run)
    _prove_keys(run)


def _prove_keys(run: SourceMerge) -> None:
    """Every copied row of a table keyed by a hash of its content (``Format.proven``)
    gives its key: fragments, attachments, schemas. A key on both sides whose
    content differs is a conflict: one of the two files is damaged."""
    register_key_recipes(run.conn)
    tables = {t.name: t for t in run.order}
    for proof in run.fmt.proven:
        table = tables.get(proof.table)
        if table is None:
            continue
        _compare_keyed(run, proof)
        if not run.counts[table.name].added:
            continue
        computed = key_sql(proof, "s", run.packed_columns, "dagsync_unpack_src" if run.source_packed else None)
        for low, high in run.chunks(f'src."{table.name}"'):
            row = next(iter(run.conn.execute(
                f'SELECT s."{proof.key}", {computed} FROM src."{table.name}" s '
                f"WHERE s.rowid BETWEEN ? AND ? AND {is_new(run, table)} AND {computed} != s.\"{proof.key}\" LIMIT 1",
                (low, high),
            )), None)  # fmt: skip
            if row is not None:
                raise DamagedSource(
                    f"{run.source}: {table.name} {row[0]} does not match its key: its content hashes to {row[1]}; "
                    f"it was not copied, and nothing was merged - run `dagsync verify {run.source}` to see every "
                    "damaged row, and restore the source from a backup"
                )


def _compare_keyed(run: SourceMerge, proof: KeyProof) -> None:
    """Rows of ``proof.table`` whose key is on both sides hold the same content
    (where both hold it: an attachment read from a path has none in the file)."""
    differs = []
    for column in proof.columns:
        s_value, t_value = f's."{column}"', f't."{column}"'
        if (proof.table, column) in run.packed_columns:
            holds = run.packed_columns[(proof.table, column)].holds
            if run.source_packed:
                s_value = f"dagsync_unpack_src({s_value}, '{holds}')"
            if run.target_packed:
                t_value = f"dagsync_unpack({t_value}, '{holds}')"
        # As bytes: a payload resolved from a blob is a BLOB, the same text inline is TEXT.
        differs.append(
            f"({s_value} IS NOT NULL AND {t_value} IS NOT NULL AND CAST({s_value} AS BLOB) != CAST({t_value} AS BLOB))"
        )
    key = f'"{proof.key}"'
    for low, high in run.chunks(f'src."{proof.table}"'):
        for (value,) in run.conn.execute(
            f'SELECT s.{key} FROM src."{proof.table}" s JOIN main."{proof.table}" t ON t.{key} = s.{key} '
            f"WHERE s.rowid BETWEEN ? AND ? AND ({' OR '.join(differs)}) LIMIT ?",
            (low, high, MAX_CONFLICTS_SHOWN),
        ):
            run.conflict(f"{proof.table} {value} differs between the two files")


def _prove_references(run: SourceMerge) -> None:
    c = run.conn
    c.execute("CREATE TEMP TABLE IF NOT EXISTS blob_refs (hash TEXT PRIMARY KEY) WITHOUT ROWID")
    for table in run.order:
        for packed in (p for p in run.fmt.packed if p.table == table.name):
            if not run.counts[table.name].added:
                continue
            for low, high in run.chunks(f'src."{table.name}"'):
                # The distinct blobs the rows to be copied refer to, each once.
                c.execute(
                    f"INSERT OR IGNORE INTO temp.blob_refs SELECT {blob_hash_sql(packed, 's')} "
                    f'FROM src."{table.name}" s WHERE s.rowid BETWEEN ? AND ? AND {marker_sql(packed, "s")} '
                    f"AND {is_new(run, table)}",
                    (low, high),
                )
    prove_referenced(c, "src", "temp.blob_refs", lambda table: run.chunks(table))
