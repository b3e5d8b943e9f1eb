"""verify: read-only, and each check catches the damage it is for (tamper tests)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dagsync.cli import app
from dagsync.message import Message, ReasoningPart, TextPart
from dagsync.store import MessageStore
from dagsync.verify import verify
from fixtures import family


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    return family(tmp_path_factory.mktemp("v"), seed=81, machines=1, conversations=40)[0].path


@pytest.fixture
def db(tmp_path, healthy) -> Path:
    path = tmp_path / "dag.db"
    shutil.copyfile(healthy, path)
    return path


def tamper(path: Path, *sql: str) -> None:
    conn = sqlite3.connect(path)
    for statement in sql:
        conn.execute(statement)
    conn.commit()
    conn.close()


def checks(path: Path) -> dict[str, int]:
    return {name: n for name, n in verify(path).counts.items() if n}


class TestHealthy:
    def test_a_generated_database_passes(self, db):
        report = verify(db)
        assert report.ok and report.problems == () and report.messages > 100

    def test_verify_never_writes_and_works_on_a_read_only_file(self, db):
        before = db.read_bytes()
        os.chmod(db, stat.S_IRUSR)
        try:
            assert verify(db).ok
        finally:
            os.chmod(db, 0o600)
        assert db.read_bytes() == before


class TestEachCheckCatchesItsDamage:
    def test_a_changed_part(self, db):
        tamper(db, "UPDATE message_parts SET content = content || ' (edited)' WHERE rowid = "
                   "(SELECT min(rowid) FROM message_parts WHERE part_type = 'text')")  # fmt: skip
        report = verify(db)
        assert checks(db) == {"content": 1}
        assert "hash to" in report.problems[0].what and report.problems[0].table == "messages"

    def test_a_lost_part(self, db):
        tamper(db, "DELETE FROM message_parts WHERE rowid = (SELECT max(rowid) FROM message_parts)")
        assert checks(db) == {"content": 1}

    def test_a_dangling_parent(self, db):
        tamper(db, "INSERT INTO messages VALUES ('orphan', 'gone', 'h', 'user', NULL, 'x')")
        report = verify(db)
        assert checks(db)["dangling parents"] == 1
        assert str(report.problems[0]).startswith("messages orphan: its parent gone does not exist")

    def test_a_cycle(self, db):
        tamper(
            db,
            "DROP INDEX idx_messages_parent_hash_unique",
            "INSERT INTO messages VALUES ('c1', 'c2', 'h1', 'user', NULL, 'x'), ('c2', 'c1', 'h2', 'user', NULL, 'x')",
        )
        assert checks(db)["cycles"] == 2

    def test_a_broken_foreign_key(self, db):
        tamper(db, "UPDATE calls SET conversation_id = 'nowhere' WHERE rowid = 1")
        report = verify(db)
        assert checks(db) == {"foreign keys": 1}
        assert report.problems[0].what == "refers to a conversations row that does not exist"

    def test_a_duplicate_identity(self, db):
        tamper(
            db,
            "DROP INDEX idx_messages_parent_hash_unique",
            "INSERT INTO messages SELECT 'zz-copy', parent_id, content_hash, role, provider_metadata_json, created_at "
            "FROM messages WHERE id != 'root' LIMIT 1",
        )
        assert checks(db)["duplicate identities"] == 1

    def test_a_damaged_page(self, db):
        with open(db, "r+b") as f:
            f.seek(3 * 4096)
            f.write(b"\xff" * 4096)
        report = verify(db)
        assert report.counts["integrity"] >= 1 and not report.ok

    def test_rows_the_dag_branch_wrote_lossily_are_reported_not_fatal(self, tmp_path):
        path = tmp_path / "branch.db"
        with MessageStore.open(path) as store:
            store.save_chain([Message("assistant", [ReasoningPart("hm", token_count=0), TextPart("a")])])
        # What the branch's own mapping stores for that part: no token count.
        tamper(path, "UPDATE message_parts SET content_json = NULL WHERE part_type = 'reasoning'")
        report = verify(path)
        assert checks(path) == {"content": 1}
        assert "lossy mapping" in report.problems[0].what


class TestTheLlmFormat:
    @pytest.fixture(scope="class")
    @classmethod
    def logs(cls, tmp_path_factory):
        pytest.importorskip("llm")
        from fixtures import generate_llm

        path = tmp_path_factory.mktemp("llmv") / "logs.db"
        generate_llm(path, seed=82, conversations=60)
        return path

    def test_a_generated_llm_database_passes(self, logs):
        assert verify(logs).ok

    def test_a_changed_part_text(self, logs, tmp_path):
        copy = tmp_path / "logs.db"
        shutil.copyfile(logs, copy)
        tamper(copy, "UPDATE parts SET text = text || '!' WHERE rowid = (SELECT min(rowid) FROM parts WHERE text IS NOT NULL)")
        assert checks(copy) == {"content": 1}

    def test_a_changed_fragment_breaks_the_messages_that_borrow_it(self, logs, tmp_path):
        copy = tmp_path / "logs.db"
        shutil.copyfile(logs, copy)
        tamper(copy, "UPDATE fragments SET content = content || ' (edited)' WHERE id = "
                     "(SELECT min(fragment_id) FROM part_fragments)")  # fmt: skip
        assert checks(copy)["content"] >= 1

    def test_a_missing_attachment(self, logs, tmp_path):
        copy = tmp_path / "logs.db"
        shutil.copyfile(logs, copy)
        tamper(copy, "PRAGMA foreign_keys = OFF",
               "DELETE FROM attachments WHERE id = (SELECT min(attachment_id) FROM part_attachments)")  # fmt: skip
        report = verify(copy)
        assert any("attachment" in p.what and "missing" in p.what for p in report.problems)


class TestCli:
    def test_ok_exits_0(self, db):
        result = CliRunner().invoke(app, ["verify", str(db)])
        assert result.exit_code == 0
        assert result.stdout.startswith(f"{db}: ok (dag format, ") and result.stdout.endswith("messages; every check passed)\n")

    def test_problems_exit_1_and_are_listed(self, db):
        tamper(db, "INSERT INTO messages VALUES ('orphan', 'gone', 'h', 'user', NULL, 'x')")
        result = CliRunner().invoke(app, ["verify", str(db)])
        assert result.exit_code == 1
        assert result.stdout.splitlines()[1] == "  messages orphan: its parent gone does not exist [dangling parents]"


def test_a_message_map_row_without_its_owner(db):
    """dagsync's own half-state: an old id mapped to a message the file no longer has."""
    import apsw

    from dagsync import bookkeeping

    conn = apsw.Connection(str(db))
    bookkeeping.ensure(conn)
    conn.execute("INSERT INTO _dagsync_message_map (source_id, target_id) VALUES ('old-id', 'gone-id')")
    conn.close()
    problems = [p for p in verify(db).problems if p.check == "bookkeeping"]
    assert [str(p) for p in problems] == [
        "_dagsync_message_map old-id: maps to message gone-id, which the file does not have (its owner is gone) [bookkeeping]"
    ]
