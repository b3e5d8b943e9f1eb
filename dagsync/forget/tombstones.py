"""Tombstones: the conversations a file has forgotten, in ``_dagsync_forgotten``.

A tombstone is a conversation id with the time it was forgotten and, once
restored, the time it was restored. It is *live* (the conversation stays
forgotten) while it was not restored after it was forgotten. A merge takes,
for each id, the later of each time from the two files (``import_from``):
a join of two semilattices, so merging tombstones in any order, any number
of times, gives the same result, and a forget or a restore made on one
machine travels to every file the history is consolidated into.
"""

from __future__ import annotations

import apsw

from dagsync import bookkeeping

__all__ = ["FORGOTTEN", "LIVE", "PENDING", "import_from", "kept", "lifted", "live_keys_sql", "record", "restore"]

FORGOTTEN = "_dagsync_forgotten"
PENDING = "_dagsync_forget_pending"
# SQL over a tombstone row ``f``: the conversation stays forgotten.
LIVE = "(f.restored_at IS NULL OR f.restored_at < f.forgotten_at)"


def has(conn: apsw.Connection, schema: str = "main") -> bool:
    return bookkeeping.has(conn, FORGOTTEN, schema)


def kept(conn: apsw.Connection, schema: str = "main") -> bool:
    """Whether ``schema`` keeps any tombstone, live or lifted: a forget removed rows from it."""
    return has(conn, schema) and any(conn.execute(f"SELECT 1 FROM {schema}.{FORGOTTEN} LIMIT 1"))


def live_keys_sql(schema: str = "main") -> str:
    """SQL selecting the ids ``schema`` holds live tombstones for."""
    return f"SELECT f.key FROM {schema}.{FORGOTTEN} f WHERE {LIVE}"


def record(conn: apsw.Connection, keys: str, now: float) -> None:
    """Tombstone the ids ``keys`` (SQL selecting them) as forgotten at ``now``. Inside a write transaction."""
    bookkeeping.ensure(conn)
    conn.execute(
        f"INSERT INTO main.{FORGOTTEN} (key, forgotten_at) SELECT key, ? FROM ({keys}) WHERE key IS NOT NULL "
        "ON CONFLICT (key) DO UPDATE SET forgotten_at = max(forgotten_at, excluded.forgotten_at)",
        (now,),
    )


def restore(conn: apsw.Connection, keys: tuple[str, ...] | None, now: float) -> int:
    """Mark the live tombstones of ``keys`` (every one, with None) restored at ``now``; return how many.
    Inside a write transaction."""
    if not has(conn):
        return 0
    where = f"key IN ({', '.join('?' * len(keys))})" if keys is not None else "1"
    params = tuple(keys or ())
    count = next(conn.execute(f"SELECT count(*) FROM main.{FORGOTTEN} f WHERE {LIVE} AND {where}", params))[0]
    conn.execute(
        f"UPDATE main.{FORGOTTEN} AS f SET restored_at = max(?, f.forgotten_at) WHERE {LIVE} AND {where}", (now, *params)
    )
    if count:
        lifted(conn)
    return count


def import_from(conn: apsw.Connection, schema: str) -> int:
    """Take into ``main`` the tombstones of the attached ``schema`` (the later of each time);
    return how many ids changed. Writes nothing (not even the table) when none would.
    Inside a write transaction."""
    if not has(conn, schema):
        return 0
    newer = (
        f"SELECT s.key, s.forgotten_at, s.restored_at FROM {schema}.{FORGOTTEN} s "
        + (
            f"LEFT JOIN main.{FORGOTTEN} t ON t.key = s.key WHERE t.key IS NULL OR s.forgotten_at > t.forgotten_at "
            "OR coalesce(s.restored_at, -1) > coalesce(t.restored_at, -1)"
            if has(conn)
            else "WHERE 1"
        )
    )
    changed = next(conn.execute(f"SELECT count(*) FROM ({newer})"))[0]
    if not changed:
        return 0
    # A tombstone live here that the source's later restore lifts.
    lifts = has(conn) and any(conn.execute(
        f"SELECT 1 FROM main.{FORGOTTEN} t JOIN ({newer}) n ON n.key = t.key "
        "WHERE (t.restored_at IS NULL OR t.restored_at < t.forgotten_at) "
        "AND max(coalesce(t.restored_at, -1), coalesce(n.restored_at, -1)) >= max(t.forgotten_at, n.forgotten_at) LIMIT 1"
    ))  # fmt: skip
    bookkeeping.ensure(conn)
    conn.execute(
        f"INSERT INTO main.{FORGOTTEN} (key, forgotten_at, restored_at) {newer} "
        "ON CONFLICT (key) DO UPDATE SET forgotten_at = max(forgotten_at, excluded.forgotten_at), "
        "restored_at = CASE WHEN restored_at IS NULL THEN excluded.restored_at "
        "WHEN excluded.restored_at IS NULL THEN restored_at ELSE max(restored_at, excluded.restored_at) END"
    )
    if lifts:
        lifted(conn)
    return changed


def lifted(conn: apsw.Connection) -> None:
    """After tombstones were lifted (a restore, here or imported): the rows the forget
    removed lie below every source's marks, so the next merge of each reads it whole
    and brings them back (``bookkeeping.rewritten``). Inside a write transaction."""
    bookkeeping.rewritten(conn, "restore")
