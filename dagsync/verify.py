"""verify: prove a database is whole, without writing to it.

Read-only: the file is opened read-only (a read-only file works), and the
only tables verify makes are in SQLite's temp database, never in the file.
Each check returns problems naming the table, the key and what is wrong:

* ``integrity_check`` - SQLite's own page-level check;
* text - every TEXT value is UTF-8 (llm cannot read a row whose text is not;
  ``encoding.py``);
* foreign keys - ``PRAGMA foreign_key_check``;
* dangling parents - a message whose parent is not there;
* cycles - messages that never lead back to a chain's start;
* content - every message re-hashed from its stored rows: the dag format by
  the spec's contract (``canonical.py``), the llm format by llm's own recipe
  (fragments and attachments resolved, blake2b over parent and content);
* duplicate identities - two dag messages with one ``(parent_id, content_hash)``,
  two llm parts at one ``(message_hash, position)``;
* blobs (a packed file, see packed.py) - every blob decompresses to its size
  and re-hashes to its key, every dictionary re-hashes to its key, and every
  packed value refers to a blob the file has. Messages are re-hashed from
  their payloads, resolved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import apsw

from dagsync import bookkeeping
from dagsync import encoding, faults
from dagsync.db import Database, open_source
from dagsync.errors import BlobError
from dagsync.faults import one_line
from dagsync.forget import tombstones
from dagsync.formats.dag import DAG
from dagsync.packed import Blobs, frame_sql, lost_store, marker_sql, sha256
from dagsync.packed import blob_hash_sql
from dagsync.rehash import (
    DAG_COLUMNS,
    LLM_COLUMNS,
    LlmLookups,
    dag_failures,
    key_sql,
    llm_failures,
    register_key_recipes,
)

__all__ = ["Problem", "VerifyReport", "verify"]

# Problems listed per check; the count says how many there were in all.
SHOWN = 50


@dataclass(frozen=True)
class Problem:
    check: str
    table: str
    key: str
    what: str

    def __str__(self) -> str:
        return f"{self.table} {self.key}: {self.what} [{self.check}]"


@dataclass(frozen=True)
class VerifyReport:
    path: str
    format: str
    messages: int
    problems: tuple[Problem, ...]
    # Problems per check, including any beyond the ones listed.
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


@faults.named("path")
def verify(path: str | os.PathLike[str]) -> VerifyReport:
    """Check ``path`` and return every problem found (an empty tuple: healthy).

    :raises NotADatabase, UnsupportedDatabase: not a database verify can read
        (it reports damage inside a database; it does not open one that is
        not SQLite, or whose tables are views or carry foreign triggers).
    """
    with open_source(path, quick_check=False) as db:
        checks = {
            "integrity": _integrity,
            "text": _text,
            "foreign keys": _foreign_keys,
            "dangling parents": _dangling_parents,
            "cycles": _cycles,
            "duplicate identities": _duplicates,
            "content": _rehash_dag if db.format is DAG else _rehash_llm,
            "keys": _keys,
            "bookkeeping": _bookkeeping,
            "blobs": _blobs,
        }
        problems: list[Problem] = []
        counts: dict[str, int] = {}
        for name, check in checks.items():
            found = 0
            try:
                for problem in check(db):
                    found += 1
                    if found <= SHOWN:
                        problems.append(problem)
            except (apsw.Error, UnicodeDecodeError) as exc:
                # Damage bad enough to stop a check is itself the finding.
                found += 1
                why = "it read text that is not UTF-8 (the text check names it)" if faults.not_utf8(exc) else one_line(str(exc))
                problems.append(Problem(name, "database", "-", f"this check could not finish: {why}"))
            counts[name] = found
        key = db.format.message_key
        try:
            messages = next(iter(db.conn.execute(f"SELECT count(*) FROM messages WHERE {key} != 'root'")))[0]
        except apsw.Error:
            messages = -1  # unreadable: the problems say why
        return VerifyReport(str(db.path), db.format.name, messages, tuple(problems), counts)


# -- the checks: each yields problems -------------------------------------------


def _integrity(db: Database):
    for (line,) in db.conn.execute("PRAGMA integrity_check"):
        if line != "ok":
            yield Problem("integrity", "database", "-", one_line(line))


def _text(db: Database):
    for found in encoding.values(db.conn):
        key = "-" if found.rowid is None else f"rowid {found.rowid}"
        yield Problem("text", found.table, key, f"{found.column} is not UTF-8 text ({found.why})")


def _foreign_keys(db: Database):
    spec = db.format.conversations
    forgotten = bookkeeping.has(db.conn, tombstones.FORGOTTEN)
    for table, rowid, parent, fkid in db.conn.execute("PRAGMA foreign_key_check"):
        if table == "messages":
            continue  # reported, with more to say, as a dangling parent
        if forgotten and spec is not None and parent in spec.tables and _names_forgotten(db, table, rowid, fkid):
            continue  # a fork's forked_from to a thread since forgotten (dagsync/forget)
        yield Problem("foreign keys", table, f"rowid {rowid}", f"refers to a {parent} row that does not exist")


def _names_forgotten(db: Database, table: str, rowid: int, fkid: int) -> bool:
    """Whether the reference ``fkid`` of row ``rowid`` names a conversation the file forgot."""
    columns = [row[3] for row in db.conn.execute(f'PRAGMA foreign_key_list("{table}")') if row[0] == fkid]
    if len(columns) != 1:
        return False
    return any(
        db.conn.execute(
            f'SELECT 1 FROM main.{tombstones.FORGOTTEN} f JOIN main."{table}" t ON t."{columns[0]}" = f.key '
            "WHERE t.rowid = ?",
            (rowid,),
        )
    )


def _roots(db: Database) -> tuple[str, str, str]:
    """(key column, parent column, SQL true for a chain's first message ``m``)."""
    fmt = db.format
    key, parent = fmt.message_key, fmt.parent_column
    if fmt.root_id is not None:
        return key, parent, f"m.{parent} = '{fmt.root_id}' AND m.{key} != '{fmt.root_id}'"
    return key, parent, f"m.{parent} IS NULL"


def _dangling_parents(db: Database):
    key, parent, starts = _roots(db)
    for mid, pid in db.conn.execute(
        f"SELECT m.{key}, m.{parent} FROM messages m WHERE NOT ({starts}) AND m.{key} != 'root' "
        f"AND NOT EXISTS (SELECT 1 FROM messages p WHERE p.{key} = m.{parent})"
    ):
        yield Problem("dangling parents", "messages", mid, f"its parent {pid} does not exist")


def _cycles(db: Database):
    """Messages that are not reached from any chain start and are not below a
    dangling parent: their parent links go round in a circle."""
    key, parent, starts = _roots(db)
    c = db.conn
    c.execute("DROP TABLE IF EXISTS temp.verify_reached")
    c.execute("CREATE TEMP TABLE verify_reached (id TEXT PRIMARY KEY) WITHOUT ROWID")
    # Walking down from the starts and up from dangling parents' children
    # covers every message not on a cycle.
    c.execute(
        f"WITH RECURSIVE down(id) AS (SELECT m.{key} FROM messages m WHERE {starts} "
        f"UNION SELECT m.{key} FROM messages m JOIN down ON m.{parent} = down.id) "
        "INSERT OR IGNORE INTO temp.verify_reached SELECT id FROM down"
    )
    c.execute(
        f"WITH RECURSIVE down(id) AS (SELECT m.{key} FROM messages m WHERE m.{parent} IS NOT NULL "
        f"AND m.{key} != 'root' AND NOT EXISTS (SELECT 1 FROM messages p WHERE p.{key} = m.{parent}) "
        f"UNION SELECT m.{key} FROM messages m JOIN down ON m.{parent} = down.id) "
        "INSERT OR IGNORE INTO temp.verify_reached SELECT id FROM down"
    )
    try:
        for mid, pid in c.execute(
            f"SELECT {key}, {parent} FROM messages WHERE {key} != 'root' "
            f"AND {key} NOT IN (SELECT id FROM temp.verify_reached)"
        ):
            yield Problem("cycles", "messages", mid, f"is on a cycle of parent links (its parent is {pid})")
    finally:
        c.execute("DROP TABLE IF EXISTS temp.verify_reached")


def _duplicates(db: Database):
    if db.format is DAG:
        for pid, digest, n, ids in db.conn.execute(
            "SELECT parent_id, content_hash, count(*), group_concat(id, ', ') FROM messages "
            "WHERE id != 'root' GROUP BY parent_id, content_hash HAVING count(*) > 1"
        ):
            yield Problem(
                "duplicate identities", "messages", ids,
                f"{n} messages share parent {pid} and content_hash {digest[:12]}; "
                "`dagsync canonicalise` collapses them",
            )  # fmt: skip
    else:
        for message, position, n in db.conn.execute(
            "SELECT message_hash, position, count(*) FROM parts GROUP BY message_hash, position HAVING count(*) > 1"
        ):
            yield Problem("duplicate identities", "parts", f"{message} #{position}", f"{n} parts at one position")


def _rehash_dag(db: Database):
    """Every message's parts, read back, hash to its content_hash (the spec's contract)."""
    rows = db.conn.execute(
        f"SELECT {DAG_COLUMNS} FROM messages m LEFT JOIN message_parts p "
        "ON p.message_id = m.id WHERE m.id != 'root' ORDER BY m.id, p.\"order\""
    )
    for mid, what in dag_failures(rows, Blobs(db.conn)):
        yield Problem("content", "messages", mid, what)


def _rehash_llm(db: Database):
    """Every message's parent and parts, read back, hash to its key (llm's recipe)."""
    blobs = Blobs(db.conn)
    rows = db.conn.execute(
        f"SELECT {LLM_COLUMNS} FROM messages m LEFT JOIN parts p ON p.message_hash = m.hash ORDER BY m.hash, p.position"
    )
    for mhash, what in llm_failures(rows, LlmLookups(db.conn, blobs)):
        yield Problem("content", "messages", mhash, what)


def _bookkeeping(db: Database):
    """dagsync's own records hold together: every old id in ``_dagsync_message_map``
    leads to a message the file has (its owner)."""
    if not bookkeeping.has(db.conn, "_dagsync_message_map", "main"):
        return
    key = db.format.message_key
    for old, new in db.conn.execute(
        "SELECT source_id, target_id FROM _dagsync_message_map m "
        f"WHERE NOT EXISTS (SELECT 1 FROM messages t WHERE t.{key} = m.target_id)"
    ):
        yield Problem(
            "bookkeeping", "_dagsync_message_map", str(old),
            f"maps to message {new}, which the file does not have (its owner is gone)",
        )  # fmt: skip


def _keys(db: Database):
    """Every row keyed by a hash of its content (``Format.proven``) gives its key."""
    conn = db.conn
    register_key_recipes(conn)
    blobs = Blobs(conn)

    def resolved(value, holds):
        try:
            return blobs.resolve_bytes(value, holds)
        except BlobError:
            return None  # the blobs check names it

    conn.create_scalar_function("dagsync_verify_resolved", resolved, 2)
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    packed_columns = {(c.table, c.column): c for c in db.format.packed}
    resolve = "dagsync_verify_resolved" if blobs.exists() or lost_store(conn) else None
    for proof in db.format.proven:
        if proof.table not in tables:
            continue
        computed = key_sql(proof, "s", packed_columns, resolve)
        for key, digest in conn.execute(
            f'SELECT s."{proof.key}", {computed} FROM "{proof.table}" s WHERE {computed} != s."{proof.key}"'
        ):
            yield Problem("keys", proof.table, str(key), f"its content hashes to {digest}, not to its key")


def _blobs(db: Database):
    """The blob store is whole, and every packed value points into it.

    Each blob is read in bounded pieces (``Blobs.problem``): a blob whose frame
    claims more than its row records is named without being decompressed.
    """
    conn = db.conn
    store = Blobs(conn)
    present = {n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    columns = [c for c in db.format.packed if c.table in present]
    if not store.exists():
        if not lost_store(conn):
            return  # never packed: a value that reads like a reference is just a value
        # Packed once, its store gone: every packed value is unreadable.
        for column in columns:
            for (rowid,) in conn.execute(
                f'SELECT t.rowid FROM "{column.table}" t WHERE {marker_sql(column, "t")} LIMIT 1'
            ):
                yield Problem(
                    "blobs", column.table, f"rowid {rowid}",
                    f"{column.column} holds a packed value, but the file has lost its blob store "
                    "(its blobs table is gone): restore it from a backup",
                )  # fmt: skip
        return
    for column in columns:
        key = blob_hash_sql(column, "t")
        for rowid, ref in conn.execute(
            f'SELECT t.rowid, {key} FROM "{column.table}" t WHERE {marker_sql(column, "t")} AND {key} NOT IN (SELECT hash FROM blobs)'
        ):
            yield Problem("blobs", column.table, f"rowid {rowid}", f"{column.column} refers to blob {ref}, which is missing")
    for key, data in conn.execute("SELECT hash, CAST(data AS BLOB) FROM blob_dicts"):
        if sha256(data) != key:
            yield Problem("blobs", "blob_dicts", key, "the dictionary's bytes do not hash to its key")
    for rowid, key, dict_key, frame, size in conn.execute(f"SELECT {frame_sql('b')} FROM blobs b"):
        try:
            what = store.problem_in_row(rowid, key, dict_key, frame, size)
        except LookupError as exc:
            what = f"cannot be read: {exc}"
        if what is not None:
            yield Problem("blobs", "blobs", key, what)
