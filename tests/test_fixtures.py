"""The fixture generator: deterministic, realistic, and a family that shares then diverges."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dagsync.stats import stats
from fixtures import family, generate


def dump(path: Path) -> list:
    conn = sqlite3.connect(path)
    out = [
        conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
        for t in ("messages", "message_parts", "calls", "conversations", "responses")
    ]
    conn.close()
    return out


def q(path: Path, sql: str) -> int:
    conn = sqlite3.connect(path)
    (n,) = conn.execute(sql).fetchone()
    conn.close()
    return n


@pytest.fixture(scope="module")
def machines(tmp_path_factory) -> list[Path]:
    return [r.path for r in family(tmp_path_factory.mktemp("fam"), seed=11, machines=2, conversations=300)]


def test_the_same_seed_makes_the_same_database(tmp_path):
    generate(tmp_path / "a.db", seed=5, conversations=40)
    generate(tmp_path / "b.db", seed=5, conversations=40)
    generate(tmp_path / "c.db", seed=6, conversations=40)
    assert dump(tmp_path / "a.db") == dump(tmp_path / "b.db")
    assert dump(tmp_path / "a.db") != dump(tmp_path / "c.db")


@pytest.mark.parametrize(
    "what, sql",
    [
        ("a system prompt shared by many conversations",
         "SELECT max(n) FROM (SELECT count(*) n FROM messages m JOIN messages c ON c.parent_id = m.id "
         "WHERE m.role = 'system' GROUP BY m.id)"),
        ("forks", "SELECT count(*) FROM conversations WHERE name LIKE 'fork of %'"),
        ("tool calls", "SELECT count(*) FROM message_parts WHERE part_type = 'tool_call'"),
        ("server-executed tool calls", "SELECT count(*) FROM message_parts WHERE part_type = 'tool_call' AND server_executed = 1"),
        ("failed tool results", "SELECT count(*) FROM message_parts WHERE part_type = 'tool_result' AND content_json LIKE '%Error%'"),
        ("tool results with attachments", "SELECT count(*) FROM message_parts WHERE content_json LIKE '%\"attachments\"%'"),
        ("reasoning with provider metadata", "SELECT count(*) FROM message_parts WHERE part_type = 'reasoning' AND content_json LIKE '%signature%'"),
        ("reasoning with a token count of 0", "SELECT count(*) FROM message_parts WHERE content_json LIKE '%\"token_count\": 0%'"),
        ("attachments", "SELECT count(*) FROM message_parts WHERE part_type = 'attachment'"),
        ("calls that failed", "SELECT count(*) FROM calls WHERE error IS NOT NULL AND head_output_message_id IS NULL"),
        ("calls with several output messages",
         "SELECT count(*) FROM calls c JOIN messages o ON o.id = c.head_output_message_id "
         "WHERE o.parent_id != c.head_input_message_id"),
        ("a legacy responses row per call", "SELECT count(*) FROM responses r JOIN calls c ON c.id = r.id"),
        ("code in the text", "SELECT count(*) FROM message_parts WHERE content LIKE '%```python%'"),
    ],
)
def test_a_generated_history_has(machines, what, sql):
    assert q(machines[0], sql) > 1, what


def test_both_timestamp_spellings(machines):
    assert q(machines[0], "SELECT count(*) FROM messages WHERE created_at LIKE '%T%Z'") > 0
    assert q(machines[1], "SELECT count(*) FROM messages WHERE created_at LIKE '% %+00:00'") > 0


class TestFamily:
    def test_machines_share_a_synced_history(self, machines):
        conn = sqlite3.connect(machines[0])
        conn.execute(f"ATTACH '{machines[1]}' AS other")
        shared = conn.execute("SELECT count(*) FROM conversations JOIN other.conversations USING (id)").fetchone()[0]
        diverged = conn.execute(
            "SELECT count(*) FROM conversations a JOIN other.conversations b USING (id) "
            "WHERE a.head_message_id IS NOT b.head_message_id"
        ).fetchone()[0]
        # Same content under the same parent, stored independently under different ids.
        collisions = conn.execute(
            "SELECT count(*) FROM messages a JOIN other.messages b "
            "ON a.parent_id = b.parent_id AND a.content_hash = b.content_hash AND a.id != b.id"
        ).fetchone()[0]
        conn.close()
        assert shared >= 150  # the shared conversations and their forks
        assert diverged > 0
        assert collisions > 0

    def test_every_machine_is_a_valid_dag_database(self, machines):
        for path in machines:
            assert stats(path).format == "dag"
