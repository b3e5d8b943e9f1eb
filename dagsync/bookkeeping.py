"""dagsync's own tables inside a database, all named ``_dagsync_*``.

They are created on first need, carry one row recording their layout version,
and are ignored by llm: a file without them is an ordinary llm database.
"""

from __future__ import annotations

import apsw

LAYOUT_VERSION = "1"

DDL = """
CREATE TABLE IF NOT EXISTS _dagsync_meta (key TEXT PRIMARY KEY, value TEXT);
INSERT OR IGNORE INTO _dagsync_meta (key, value) VALUES ('layout_version', '1');
-- A merged message stored under another id in this file: a holder of the old
-- id (a user, a later merge) finds the surviving row here.
CREATE TABLE IF NOT EXISTS _dagsync_message_map (
    source_id TEXT PRIMARY KEY,
    target_id TEXT NOT NULL
);
-- A fork row a merge added for a diverged pointer, so a second merge of the
-- same source does not add it again.
CREATE TABLE IF NOT EXISTS _dagsync_forks (
    pointer_table TEXT NOT NULL,
    key TEXT NOT NULL,
    head TEXT NOT NULL,
    fork_key TEXT NOT NULL,
    PRIMARY KEY (pointer_table, key, head)
);
-- When gc first found a row unreachable (a message with no time of its own)
-- or unreferenced (a shared row such as a fragment): gc deletes it only once
-- the grace period has passed since. A row reachable again is dropped from here.
CREATE TABLE IF NOT EXISTS _dagsync_gc_seen (
    tbl TEXT NOT NULL,
    key TEXT NOT NULL,
    first_seen REAL NOT NULL,  -- unix time
    PRIMARY KEY (tbl, key)
);
"""


def ensure(conn: apsw.Connection) -> None:
    """Create the bookkeeping tables if missing. Call inside a write transaction."""
    conn.execute(DDL)


def has(conn: apsw.Connection, table: str, schema: str = "main") -> bool:
    return any(conn.execute(f"SELECT 1 FROM {schema}.sqlite_schema WHERE type = 'table' AND name = ?", (table,)))
