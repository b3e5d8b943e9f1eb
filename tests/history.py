"""Reading a dag database's history by content, with plain SQL, for tests.

Ids differ between files that stored the same content independently, so
"the same history" means the same content paths: a message is named by the
content hashes from the root down to it.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

PATHS_SQL = """
WITH RECURSIVE path(id, p) AS (
    SELECT id, content_hash FROM messages WHERE parent_id = 'root' AND id != 'root'
    UNION ALL
    SELECT m.id, path.p || '/' || m.content_hash FROM messages m JOIN path ON m.parent_id = path.id
)
SELECT id, p FROM path
"""


def connect(path: Path) -> sqlite3.Connection:
    journal = Path(f"{path}-journal")
    if journal.exists() and journal.stat().st_size:
        # A process killed mid-write left a hot journal; a read-only connection
        # cannot roll it back. Do what the next llm or dagsync would: open the
        # file read-write once, which rolls it back.
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("PRAGMA schema_version").fetchone()
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def message_paths(path: Path) -> dict[str, str]:
    """Message id -> its content path."""
    with connect(path) as conn:
        return dict(conn.execute(PATHS_SQL).fetchall())


def logical(path: Path) -> dict[str, object]:
    """Everything a merge must preserve, with ids replaced by content paths where
    ids may legitimately differ (messages, integer surrogate keys)."""
    paths = message_paths(path)
    paths["root"] = ""
    with connect(path) as conn:
        q = conn.execute
        return {
            "messages": set(paths.values()) - {""},
            "parts": {
                (paths[m], o, t, c, j)
                for m, o, t, c, j in q('SELECT message_id, "order", part_type, content, content_json FROM message_parts')
            },
            # Fork rows get new ids: compare heads as a set, and original ids apart.
            "heads": {paths.get(h) for (h,) in q("SELECT head_message_id FROM conversations")},
            "calls": {
                (i, paths.get(a), paths.get(b), m, e)
                for i, a, b, m, e in q(
                    "SELECT id, head_input_message_id, head_output_message_id, model, error FROM calls"
                )
            },
            "responses": set(q("SELECT id, prompt, response, conversation_id, schema_id FROM responses")),
            "fragments": set(q("SELECT hash, content FROM fragments")),
            "aliases": set(q("SELECT a.alias, f.hash FROM fragment_aliases a JOIN fragments f ON f.id = a.fragment_id")),
            "system_fragments": set(q(
                "SELECT s.response_id, f.hash, s.\"order\" FROM system_fragments s JOIN fragments f ON f.id = s.fragment_id"
            )),
            "prompt_fragments": set(q(
                "SELECT s.response_id, f.hash, s.\"order\" FROM prompt_fragments s JOIN fragments f ON f.id = s.fragment_id"
            )),
            "tool_calls": sorted(q(
                "SELECT c.response_id, t.hash, c.name, c.arguments, c.tool_call_id FROM tool_calls c "
                "LEFT JOIN tools t ON t.id = c.tool_id"
            )),
            "tool_results": sorted(q(
                "SELECT r.response_id, t.hash, r.name, r.output, r.tool_call_id, i.name, r.exception, "
                "(SELECT group_concat(a.attachment_id) FROM tool_results_attachments a WHERE a.tool_result_id = r.id) "
                "FROM tool_results r LEFT JOIN tools t ON t.id = r.tool_id LEFT JOIN tool_instances i ON i.id = r.instance_id"
            )),
            "attachments": set(q("SELECT id, type, url, content FROM attachments")),
            "prompt_attachments": set(q('SELECT response_id, attachment_id, "order" FROM prompt_attachments')),
            "tool_responses": set(q("SELECT r.response_id, t.hash FROM tool_responses r JOIN tools t ON t.id = r.tool_id")),
            "schemas": set(q("SELECT id, content FROM schemas")),
        }  # fmt: skip


def conversation_chains(path: Path) -> dict[str, list[str]]:
    """Conversation id -> the content path of its head, split into hashes."""
    paths = message_paths(path)
    with connect(path) as conn:
        return {
            cid: (paths[h].split("/") if h and h != "root" else [])
            for cid, h in conn.execute("SELECT id, head_message_id FROM conversations")
        }


def integrity(path: Path) -> list[str]:
    """Guarantee 1: every reference resolves. Returns the problems found."""
    problems = []
    with connect(path) as conn:
        problems += [f"foreign key: {row}" for row in conn.execute("PRAGMA foreign_key_check")]
        problems += [
            f"dangling parent: {row}"
            for row in conn.execute(
                "SELECT id, parent_id FROM messages m WHERE NOT EXISTS "
                "(SELECT 1 FROM messages p WHERE p.id = m.parent_id)"
            )
        ]
        problems += [
            f"part without message: {row}"
            for row in conn.execute(
                "SELECT id FROM message_parts p WHERE NOT EXISTS (SELECT 1 FROM messages m WHERE m.id = p.message_id)"
            )
        ]
        (ok,) = conn.execute("PRAGMA integrity_check").fetchone()
        if ok != "ok":
            problems.append(f"integrity_check: {ok}")
    return problems


def union_of(*logicals: dict[str, object]) -> dict[str, object]:
    """What a target must hold at least: every source's history."""
    out: dict[str, object] = {}
    for part in logicals:
        for key, value in part.items():
            if isinstance(value, set):
                out[key] = out.get(key, set()) | value  # type: ignore[operator]
    return out


def contains(big: dict[str, object], small: dict[str, object]) -> list[str]:
    """Keys of ``small`` whose rows are not all in ``big``."""
    missing = []
    for key, value in small.items():
        if key == "heads":
            # A head is kept when it, or a descendant of it (a fast-forward), is a head.
            heads = big[key]  # type: ignore[index]
            lost = {
                h for h in value  # type: ignore[union-attr]
                if h is not None and not any(t == h or (t or "").startswith(h + "/") for t in heads)
            }
            if lost:
                missing.append(f"heads: {len(lost)} lost")
        elif isinstance(value, set):
            lost = value - big[key]  # type: ignore[operator]
            if lost:
                missing.append(f"{key}: {len(lost)} lost, e.g. {sorted(map(str, lost))[:2]}")
        else:
            lost_rows = [row for row in value if row not in big[key]]  # type: ignore[union-attr]
            if lost_rows:
                missing.append(f"{key}: {len(lost_rows)} lost, e.g. {lost_rows[:2]}")
    return missing


def content_dump(path: Path, leave_out: tuple[str, ...] = ()) -> list[str]:
    """A file's schema and rows as llm sees them, for comparing two files that must hold the same.

    Every schema object (as a set: a full-text index that unpack made again
    comes later in ``sqlite_schema``), then every row of every table in
    order, but of lines naming any of ``leave_out`` (dagsync's bookkeeping,
    say). A full-text index is compared by what it indexes (``fts5vocab``:
    every term of every document, column and offset) and its own check, not
    by its shadow tables' pages, which depend on the order rows were indexed in.
    """
    with contextlib.closing(sqlite3.connect(path)) as conn:
        indexes = [n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE sql LIKE 'CREATE VIRTUAL TABLE%USING FTS5%'")]
        shadow = tuple(f'INSERT INTO "{n}_' for n in indexes)
        lines = [
            line for line in conn.iterdump()
            if not any(t in line for t in leave_out) and not line.startswith(shadow)
        ]  # fmt: skip
        schema = sorted(line for line in lines if not line.startswith('INSERT INTO "'))
        rows = [line for line in lines if line.startswith('INSERT INTO "')]
        searched = []
        for name in indexes:
            conn.execute(f"INSERT INTO \"{name}\" (\"{name}\") VALUES ('integrity-check')")
            conn.execute(f"CREATE VIRTUAL TABLE temp.\"vocab_{name}\" USING fts5vocab(main, '{name}', 'instance')")
            # Terms as hex: a BLOB that was indexed gives terms that are not UTF-8.
            searched += [
                f"{name}: {row}"
                for row in conn.execute(f'SELECT hex(term), doc, col, "offset" FROM temp."vocab_{name}" ORDER BY 1, 2, 3, 4')
            ]  # fmt: skip
        return schema + rows + searched
