"""The llm-format fixture generator: real llm 0.36 databases, deterministic, and a family that diverges."""

from __future__ import annotations

import json
import sqlite3
import stat
from pathlib import Path

import pytest

llm = pytest.importorskip("llm")

import sqlite_utils  # noqa: E402  (installed with llm)
from llm.logs import LogStore, condense_payload, log_rows  # noqa: E402

import fixtures.llm_format as llm_format  # noqa: E402
from dagsync.db import open_source  # noqa: E402
from dagsync.formats.llm import MIGRATIONS  # noqa: E402
from dagsync.stats import stats  # noqa: E402
from fixtures import family_llm, generate_llm  # noqa: E402
from fixtures.__main__ import main  # noqa: E402

KEY_TABLES = (
    "messages", "parts", "part_attachments", "part_fragments", "threads", "turns",
    "turn_tools", "turn_fragments", "turn_search", "tool_instantiations", "fragments",
    "fragment_aliases", "attachments", "tools", "tool_instances", "schemas", "_llm_migrations",
)  # fmt: skip


def dump(path: Path) -> dict:
    conn = sqlite3.connect(path)
    out = {t: conn.execute(f'SELECT * FROM "{t}" ORDER BY 1').fetchall() for t in KEY_TABLES}
    conn.close()
    return out


def q(path: Path, sql: str):
    conn = sqlite3.connect(path)
    (value,) = conn.execute(sql).fetchone()
    conn.close()
    return value


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llm") / "logs.db"
    generate_llm(path, seed=3, conversations=240)
    return path


@pytest.fixture(scope="module")
def machines(tmp_path_factory) -> list[Path]:
    reports = family_llm(tmp_path_factory.mktemp("llm-fam"), seed=11, machines=2, conversations=240)
    return [r.path for r in reports]


def test_the_same_seed_makes_the_same_database(tmp_path):
    a = generate_llm(tmp_path / "a.db", seed=5, conversations=40)
    generate_llm(tmp_path / "b.db", seed=5, conversations=40)
    generate_llm(tmp_path / "c.db", seed=6, conversations=40)
    assert a.conversations >= 40 and a.messages > 100 and a.calls > 80
    assert dump(tmp_path / "a.db") == dump(tmp_path / "b.db")
    assert dump(tmp_path / "a.db")["messages"] != dump(tmp_path / "c.db")["messages"]


def test_the_same_seed_makes_the_same_family(tmp_path):
    first = family_llm(tmp_path / "x", seed=2, conversations=30)
    second = family_llm(tmp_path / "y", seed=2, conversations=30)
    assert [r.path.name for r in first] == ["machine-1.db", "machine-2.db"]
    for a, b in zip(first, second):
        assert dump(a.path) == dump(b.path)
    assert not (tmp_path / "x" / ".shared-llm.db").exists()


class TestARealLlmDatabase:
    def test_it_is_llms_own_schema_and_migrations(self, one, tmp_path):
        fresh = tmp_path / "fresh.db"
        LogStore(sqlite_utils.Database(fresh))  # migrates a new file, as llm does

        def schema(path):
            return q(path, "SELECT group_concat(sql, ';') FROM (SELECT sql FROM sqlite_schema ORDER BY name)")

        assert schema(one) == schema(fresh)
        conn = sqlite3.connect(one)
        assert [r[0] for r in conn.execute("SELECT name FROM _llm_migrations ORDER BY rowid")] == list(MIGRATIONS)
        conn.close()

    def test_it_is_owner_only(self, one, machines):
        for path in (one, *machines):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600

    def test_every_message_hash_verifies(self, one, machines):
        for path in (one, *machines):
            assert LogStore(sqlite_utils.Database(path)).verify() == []

    def test_every_thread_loads(self, one, machines):
        for path in (one, *machines):
            store = LogStore(sqlite_utils.Database(path))
            for (thread_id,) in store.db.execute("SELECT id FROM threads").fetchall():
                assert store.thread_messages(thread_id)

    def test_no_dangling_reference(self, one, machines):
        for path in (one, *machines):
            conn = sqlite3.connect(path)
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            conn.close()

    def test_dagsync_accepts_it(self, one, machines):
        for path in (one, *machines):
            with open_source(path) as db:
                assert db.format.name == "llm"
            s = stats(path)
            assert (s.format, s.conversations, s.calls) == (
                "llm", q(path, "SELECT count(*) FROM threads"), q(path, "SELECT count(*) FROM turns"),
            )  # fmt: skip

    def test_turns_delimit_what_they_added_as_llm_does(self, one):
        """parent_message_hash is the tip of the turn's input, tip_message_hash of its output."""
        store = LogStore(sqlite_utils.Database(one))
        rows = store.db.execute("SELECT id, parent_message_hash, tip_message_hash FROM turns").fetchall()
        for turn_id, parent, tip in rows:
            inputs = store.load_chain(parent)
            outputs = store.load_chain(tip)[len(inputs) :]
            assert inputs[-1].role in ("user", "tool"), turn_id
            assert store.load_chain(tip)[: len(inputs)] == inputs
            assert all(m.role == "assistant" for m in outputs)
        # Every thread's tip is its last turn's tip, or the message it was forked at.
        assert q(
            one,
            "SELECT count(*) FROM threads t WHERE tip_message_hash IS NOT "
            "(SELECT tip_message_hash FROM turns WHERE thread_id = t.id ORDER BY id DESC LIMIT 1) "
            "AND EXISTS (SELECT 1 FROM turns WHERE thread_id = t.id)",
        ) == 0

    def test_llm_logs_reads_it(self, one):
        store = LogStore(sqlite_utils.Database(one))
        rows = log_rows(store, count=200)
        assert len(rows) == 200
        assert any(r["prompt"] and r["response"] for r in rows)
        assert log_rows(store, query="python", count=5)
        for (turn_id,) in store.db.execute("SELECT id FROM turns WHERE response_json IS NOT NULL").fetchall():
            assert isinstance(store.turn_response_json(turn_id), dict)

    def test_payloads_are_condensed_exactly_as_llm_condenses_them(self, tmp_path, monkeypatch):
        fast = llm_format._condense
        compared = []

        def both(payload, outputs, tools, schema):
            ours = fast(payload, outputs, tools, schema)
            assert ours == condense_payload(payload, outputs, tools, schema=schema)
            compared.append(ours)
            return ours

        monkeypatch.setattr(llm_format, "_condense", both)
        generate_llm(tmp_path / "c.db", seed=9, conversations=80)
        payloads = [c for c in compared if c is not None]
        assert len(payloads) > 20
        assert any('{"$": "0.' in p for p in payloads)  # message content referenced, not copied

    def test_the_command_line(self, tmp_path, capsys):
        assert main(["llm", str(tmp_path / "cli.db"), "--conversations", "5", "--seed", "1"]) == 0
        assert main(["llm", str(tmp_path / "fam"), "--family", "--conversations", "6"]) == 0
        assert "machine-2.db" in capsys.readouterr().out
        assert q(tmp_path / "cli.db", "SELECT count(*) FROM threads") >= 5


@pytest.mark.parametrize(
    "what, sql",
    [
        ("a system prompt shared by many threads",
         "SELECT max(n) FROM (SELECT count(*) n FROM messages m JOIN messages c ON c.parent_hash = m.hash "
         "WHERE m.role = 'system' GROUP BY m.hash)"),
        ("a first question asked in several threads",
         "SELECT count(*) FROM messages m WHERE role = 'user' AND (SELECT count(*) FROM messages c "
         "WHERE c.parent_hash = m.hash) > 1"),
        ("long conversations", "SELECT count(*) FROM (SELECT thread_id FROM turns GROUP BY thread_id HAVING count(*) >= 8)"),
        ("forks", "SELECT count(*) FROM threads WHERE forked_from IS NOT NULL"),
        ("forks continued", "SELECT count(DISTINCT thread_id) FROM turns JOIN threads t ON t.id = thread_id WHERE t.forked_from IS NOT NULL"),
        ("threads continued later",
         "SELECT count(*) FROM (SELECT thread_id FROM turns GROUP BY thread_id "
         "HAVING julianday(max(datetime_utc)) - julianday(min(datetime_utc)) > 1)"),
        ("tool calls", "SELECT count(*) FROM parts WHERE type = 'tool_call'"),
        ("server-executed tool calls", "SELECT count(*) FROM parts WHERE type = 'tool_call' AND payload LIKE '%\"server_executed\": true%'"),
        ("tool results fed back", "SELECT count(*) FROM turns t JOIN messages m ON m.hash = t.parent_message_hash WHERE m.role = 'tool'"),
        ("failed tool results", "SELECT count(*) FROM parts WHERE type = 'tool_result' AND payload LIKE '%\"exception\"%'"),
        ("tool results with attachments", "SELECT count(*) FROM parts p JOIN part_attachments a ON a.part_id = p.id WHERE p.type = 'tool_result'"),
        ("tools", "SELECT count(*) FROM tools"),
        ("turn_tools", "SELECT count(*) FROM turn_tools"),
        ("turn_tools with an instance", "SELECT count(*) FROM turn_tools WHERE instance_id IS NOT NULL"),
        ("tool instances", "SELECT count(*) FROM tool_instances"),
        ("tool_instantiations", "SELECT count(*) FROM tool_instantiations"),
        ("reasoning with provider metadata", "SELECT count(*) FROM parts WHERE type = 'reasoning' AND payload LIKE '%provider_metadata%'"),
        ("redacted reasoning", "SELECT count(*) FROM parts WHERE type = 'reasoning' AND payload LIKE '%\"redacted\": true%' AND text = ''"),
        ("message provider metadata", "SELECT count(*) FROM messages WHERE provider_metadata IS NOT NULL"),
        ("attachments stored once", "SELECT count(*) FROM attachments WHERE content IS NOT NULL"),
        ("URL attachments", "SELECT count(*) FROM attachments WHERE url IS NOT NULL"),
        ("attachment parts", "SELECT count(*) FROM parts p JOIN part_attachments a ON a.part_id = p.id WHERE p.type = 'attachment'"),
        ("an attachment used more than once", "SELECT max(n) FROM (SELECT count(*) n FROM part_attachments GROUP BY attachment_id)"),
        ("fragments", "SELECT count(*) FROM fragments"),
        ("fragment aliases", "SELECT count(*) FROM fragment_aliases"),
        ("text borrowing fragments", "SELECT count(*) FROM parts WHERE payload LIKE '%\"text_ref\"%' AND text IS NULL"),
        ("part_fragments", "SELECT count(*) FROM part_fragments"),
        ("system fragments", "SELECT count(*) FROM turn_fragments WHERE kind = 'system'"),
        ("prompt fragments", "SELECT count(*) FROM turn_fragments WHERE kind = 'prompt'"),
        ("a fragment used by several turns", "SELECT max(n) FROM (SELECT count(*) n FROM turn_fragments GROUP BY fragment_id)"),
        ("schemas used by turns", "SELECT count(*) FROM turns WHERE schema_id IS NOT NULL"),
        ("condensed provider payloads", "SELECT count(*) FROM turns WHERE response_json LIKE '%{\"$\": \"0.%'"),
        ("turns that produced nothing", "SELECT count(*) FROM turns WHERE tip_message_hash = parent_message_hash"),
        ("turns with several output messages",
         "SELECT count(*) FROM turns t JOIN messages o ON o.hash = t.tip_message_hash WHERE o.parent_hash != t.parent_message_hash"),
        ("options and token details", "SELECT count(*) FROM turns WHERE options_json IS NOT NULL AND token_details IS NOT NULL"),
        ("resolved models", "SELECT count(*) FROM turns WHERE resolved_model IS NOT NULL"),
        ("code in the text", "SELECT count(*) FROM parts WHERE text LIKE '%```python%'"),
        ("a searchable row per turn with text", "SELECT count(*) FROM turn_search_fts WHERE turn_search_fts MATCH 'python'"),
    ],
)  # fmt: skip
def test_a_generated_history_has(one, what, sql):
    assert q(one, sql) > 1, what


def test_turn_search_has_a_row_for_every_turn_with_text(one):
    # llm gives a turn no search row only when it has neither a typed prompt
    # nor any text output: a tool round that answered with more tool calls.
    assert q(one, "SELECT count(*) FROM turn_search") == q(one, "SELECT count(*) FROM turn_search_fts")
    missing = q(
        one,
        "SELECT count(*) FROM turns t JOIN messages m ON m.hash = t.parent_message_hash "
        "WHERE t.id NOT IN (SELECT turn_id FROM turn_search) AND NOT (m.role = 'tool' AND NOT EXISTS "
        "(SELECT 1 FROM parts p WHERE p.message_hash = t.tip_message_hash AND p.type = 'text'))",
    )
    assert missing == 0


def test_fragment_text_is_not_searchable(one):
    conn = sqlite3.connect(one)
    part_id, payload = conn.execute(
        "SELECT p.id, p.payload FROM parts p JOIN messages m ON m.hash = p.message_hash "
        "WHERE m.role = 'user' AND p.payload LIKE '%text_ref%' LIMIT 1"
    ).fetchone()
    literal = "".join(piece.get("literal", "") for piece in json.loads(payload)["text_ref"])
    (prompt,) = conn.execute(
        "SELECT s.prompt FROM turn_search s JOIN turns t ON t.id = s.turn_id "
        "JOIN parts p ON p.message_hash = t.parent_message_hash WHERE p.id = ?",
        (part_id,),
    ).fetchone()
    conn.close()
    assert prompt == literal


class TestFamily:
    @pytest.fixture
    def conn(self, machines):
        conn = sqlite3.connect(machines[0])
        conn.execute(f"ATTACH '{machines[1]}' AS other")
        yield conn
        conn.close()

    def count(self, conn, sql: str) -> int:
        return conn.execute(sql).fetchone()[0]

    def test_machines_share_threads_and_messages(self, conn):
        assert self.count(conn, "SELECT count(*) FROM threads JOIN other.threads USING (id)") >= 100
        assert self.count(conn, "SELECT count(*) FROM turns JOIN other.turns USING (id)") > 300
        assert self.count(conn, "SELECT count(*) FROM messages JOIN other.messages USING (hash)") > 500

    def test_shared_thread_tips_diverge(self, conn):
        diverged = self.count(
            conn,
            "SELECT count(*) FROM threads a JOIN other.threads b USING (id) "
            "WHERE a.tip_message_hash IS NOT b.tip_message_hash",
        )
        assert diverged >= 10

    def test_each_machine_has_threads_of_its_own(self, conn):
        assert self.count(conn, "SELECT count(*) FROM threads WHERE id NOT IN (SELECT id FROM other.threads)") >= 100
        assert self.count(conn, "SELECT count(*) FROM other.threads WHERE id NOT IN (SELECT id FROM threads)") >= 100

    def test_the_same_question_written_independently_is_the_same_row(self, conn):
        # A machine's own new thread asks a first question, under a system
        # prompt, that the other machine has too: the same hash, one row.
        for mine, theirs in (("main", "other"), ("other", "main")):
            same = self.count(
                conn,
                f"SELECT count(*) FROM {mine}.turns t JOIN {mine}.messages m ON m.hash = t.parent_message_hash "
                f"WHERE m.role = 'user' AND t.thread_id NOT IN (SELECT id FROM {theirs}.threads) "
                f"AND m.hash IN (SELECT hash FROM {theirs}.messages)",
            )
            assert same > 0, mine

    def test_new_fragments_collide_by_id_with_different_content(self, conn):
        colliding = [
            fid for (fid,) in conn.execute(
                "SELECT a.id FROM fragments a JOIN other.fragments b USING (id) WHERE a.hash != b.hash"
            )
        ]  # fmt: skip
        assert colliding
        # ... and both machines reference colliding ids inside parts.payload text_ref.
        for schema in ("main", "other"):
            refs = {
                piece["fragment"]
                for (payload,) in conn.execute(f"SELECT payload FROM {schema}.parts WHERE payload LIKE '%text_ref%'")
                for piece in json.loads(payload)["text_ref"]
                if "fragment" in piece
            }
            assert refs & set(colliding), schema

    def test_the_same_fragment_content_under_different_ids(self, conn):
        # Not required by every seed, but this one has it: a merge must map
        # these by hash rather than copy them.
        moved = self.count(conn, "SELECT count(*) FROM fragments a JOIN other.fragments b USING (hash) WHERE a.id != b.id")
        assert moved > 0

    def test_machines_write_later_than_the_shared_history(self, conn):
        shared_latest = conn.execute(
            "SELECT max(t.datetime_utc) FROM turns t JOIN other.turns USING (id)"
        ).fetchone()[0]
        own_earliest = conn.execute(
            "SELECT min(datetime_utc) FROM turns WHERE id NOT IN (SELECT id FROM other.turns)"
        ).fetchone()[0]
        assert own_earliest > shared_latest
