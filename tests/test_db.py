"""Opening databases: every refusal, with its exact message, and the source's safety."""

from __future__ import annotations

import os
from pathlib import Path

import apsw
import pytest

from dagsync.db import open_source, open_target
from dagsync.transactions import write_transaction
from dagsync.errors import NotADatabase, UnsupportedDatabase
from dagsync.formats.dag import DAG
from dagsync.formats.llm import LLM
from dagsync.store import MessageStore
from dagsync.message import Message, TextPart


def make(path: Path, sql: str) -> Path:
    conn = apsw.Connection(str(path))
    conn.execute(sql)
    conn.close()
    return path


@pytest.fixture
def dag_file(tmp_path: Path) -> Path:
    path = tmp_path / "dag.db"
    with MessageStore.open(path) as store:
        store.save_chain([Message("user", [TextPart("hello")])])
    return path


def refusal(path: Path) -> str:
    with pytest.raises((NotADatabase, UnsupportedDatabase)) as info:
        open_source(path)
    return str(info.value)


class TestNotADatabase:
    def test_missing(self, tmp_path):
        assert refusal(tmp_path / "nope.db") == f"{tmp_path / 'nope.db'}: no such file"

    def test_a_directory(self, tmp_path):
        assert refusal(tmp_path) == f"{tmp_path} is a directory, not a database file"

    def test_empty(self, tmp_path):
        path = tmp_path / "empty.db"
        path.write_bytes(b"")
        assert refusal(path) == f"{path} is empty (0 bytes): it is not an llm database"

    def test_not_sqlite(self, tmp_path):
        path = tmp_path / "notes.txt"
        path.write_text("dear diary " * 50)
        assert refusal(path) == f"{path} is not a SQLite database (it does not start with the SQLite header)"

    def test_truncated(self, dag_file):
        size = dag_file.stat().st_size
        with open(dag_file, "r+b") as f:
            f.truncate(size // 2)
        assert refusal(dag_file) == (
            f"{dag_file} is truncated: its header says {size} bytes but the file has "
            f"{size // 2}; restore it from a backup"
        )

    def test_truncated_inside_the_header(self, tmp_path):
        path = tmp_path / "stub.db"
        path.write_bytes(b"SQLite format 3\x00" + b"\x10\x00")
        assert refusal(path) == f"{path} is truncated: it ends inside the SQLite header"

    def test_damaged(self, dag_file):
        # Overwrite one page in the middle of the file with garbage.
        page = 4096
        with open(dag_file, "r+b") as f:
            f.seek(3 * page)
            f.write(b"\xff" * page)
        message = refusal(dag_file)
        assert message.startswith(f"{dag_file} is damaged: PRAGMA quick_check says: ")
        assert message.endswith(
            f"; restore it from a backup, or recover a copy with `sqlite3 {dag_file} .recover`"
        )


class TestNotAnLlmDatabase:
    def test_an_empty_sqlite_database(self, tmp_path):
        path = make(tmp_path / "blank.db", "CREATE TABLE t(x); DROP TABLE t;")
        assert refusal(path) == f"{path} is an empty SQLite database: it has no tables"

    def test_a_foreign_schema(self, tmp_path):
        path = make(tmp_path / "shop.db", "CREATE TABLE orders(id); CREATE TABLE customers(id);")
        assert refusal(path) == f"{path} is not an llm database: it has no messages table (tables: customers, orders)"

    def test_an_llm_database_from_before_the_message_store(self, tmp_path):
        path = make(
            tmp_path / "old.db",
            "CREATE TABLE _llm_migrations(name TEXT PRIMARY KEY, applied_at TEXT);"
            "CREATE TABLE responses(id TEXT PRIMARY KEY, prompt TEXT);",
        )
        assert refusal(path) == (
            f"{path} is an llm database from before the message store (it has llm's "
            "responses table but no messages table): open it once with llm 0.32 or later "
            f"(for example `llm logs -n 1 -d {path}`), which migrates it, then try again"
        )

    def test_a_messages_table_of_neither_format(self, tmp_path):
        path = make(tmp_path / "parts.db", "CREATE TABLE messages(id TEXT, response_id TEXT, direction TEXT)")
        assert refusal(path) == (
            f"{path} has a messages table of an unknown layout (columns: id, response_id, "
            "direction): it is neither the dag format (id, parent_id, content_hash) nor "
            "the llm format (hash, parent_hash)"
        )

    def test_a_half_migrated_file(self, dag_file):
        conn = apsw.Connection(str(dag_file))
        conn.execute("DROP TABLE calls")
        conn.close()
        assert refusal(dag_file) == (
            f"{dag_file} looks like the dag format but has no calls table: it is "
            "half-migrated or damaged; open it with the llm that wrote it, then try again"
        )

    def test_a_table_missing_a_column(self, dag_file):
        conn = apsw.Connection(str(dag_file))
        conn.execute("ALTER TABLE responses DROP COLUMN resolved_model")
        conn.close()
        assert refusal(dag_file) == (
            f"{dag_file}: table 'responses' lacks column(s) resolved_model of the dag "
            "format; the file is from an older llm: open it with the llm that wrote it "
            "(which migrates it), then try again"
        )


class TestHostileSources:
    """Nothing a source carries may run: its views and triggers are refused unread."""

    def test_a_view_posing_as_messages_is_refused_without_being_read(self, tmp_path):
        # Reading (or even preparing) this view fails with "no such function";
        # the refusal must come first.
        path = make(tmp_path / "view.db", "CREATE VIEW messages AS SELECT boom() AS id, 1 AS parent_id")
        assert refusal(path) == (
            f"{path}: 'messages' is a view, not a table; dagsync reads only real tables "
            "from a source, so it refused the file without reading it"
        )

    def test_a_view_posing_as_another_table(self, dag_file):
        conn = apsw.Connection(str(dag_file))
        conn.execute("DROP TABLE calls; CREATE VIEW calls AS SELECT boom() AS id")
        conn.close()
        assert refusal(dag_file) == (
            f"{dag_file}: 'calls' is a view, not a table; dagsync reads only real tables "
            "from a source, so it refused the file without reading it"
        )

    def test_an_unknown_trigger(self, dag_file):
        conn = apsw.Connection(str(dag_file))
        conn.execute("CREATE TRIGGER sneaky AFTER INSERT ON messages BEGIN DELETE FROM calls; END")
        conn.close()
        assert refusal(dag_file) == (
            f"{dag_file}: trigger 'sneaky' on table 'messages' is not one llm creates; "
            "dagsync does not read sources altered this way (it never runs their "
            "triggers); drop the trigger in a copy if you trust the file"
        )

    def test_a_trigger_named_like_a_table(self, dag_file):
        conn = apsw.Connection(str(dag_file))
        conn.execute("CREATE TRIGGER messages AFTER INSERT ON _llm_migrations BEGIN SELECT 1; END")
        conn.close()
        assert refusal(dag_file) == (
            f"{dag_file}: trigger 'messages' on table '_llm_migrations' is not one llm "
            "creates; dagsync does not read sources altered this way (it never runs their "
            "triggers); drop the trigger in a copy if you trust the file"
        )

    def test_a_known_trigger_name_with_another_body(self, dag_file):
        conn = apsw.Connection(str(dag_file))
        conn.execute(
            "DROP TRIGGER responses_ai; CREATE TRIGGER responses_ai AFTER INSERT ON responses "
            "BEGIN DELETE FROM messages; END"
        )
        conn.close()
        assert "trigger 'responses_ai' on table 'responses' is not one llm creates" in refusal(dag_file)

    def test_llm_s_own_triggers_are_fine(self, dag_file):
        with open_source(dag_file) as db:
            assert db.format is DAG

    def test_a_fake_fts_index(self, dag_file):
        conn = apsw.Connection(str(dag_file))
        conn.execute("DROP TABLE responses_fts; CREATE TABLE responses_fts(prompt, response)")
        conn.close()
        assert refusal(dag_file) == (
            f"{dag_file}: 'responses_fts' is not the FTS5 index llm creates; dagsync "
            "refused the file without reading it"
        )

    def test_a_source_is_read_only(self, dag_file):
        before = dag_file.read_bytes()
        with open_source(dag_file) as db:
            with pytest.raises(apsw.ReadOnlyError):
                db.conn.execute("DELETE FROM messages")
        assert dag_file.read_bytes() == before

    def test_a_source_runs_in_defensive_mode_without_schema_trust(self, dag_file):
        with open_source(dag_file) as db:
            assert db.conn.config(apsw.SQLITE_DBCONFIG_DEFENSIVE, -1) == 1
            assert db.conn.config(apsw.SQLITE_DBCONFIG_TRUSTED_SCHEMA, -1) == 0


class TestFormats:
    def test_a_store_file_is_dag(self, dag_file):
        with open_source(dag_file) as db:
            assert db.format is DAG

    def test_the_llm_schema_is_llm(self, tmp_path):
        path = make(tmp_path / "logs.db", LLM.schema_sql)
        with open_source(path) as db:
            assert db.format is LLM


class TestTargets:
    def test_a_created_target_is_owner_only(self, tmp_path):
        path = tmp_path / "t.db"
        old = os.umask(0o022)
        try:
            with open_target(path, create=DAG) as db:
                assert db.format is DAG
        finally:
            os.umask(old)
        assert path.stat().st_mode & 0o777 == 0o600

    def test_a_missing_target_without_create(self, tmp_path):
        with pytest.raises(NotADatabase) as info:
            open_target(tmp_path / "t.db")
        assert str(info.value) == f"{tmp_path / 't.db'}: no such file"

    def test_write_transaction_waits_for_another_writer(self, dag_file, monkeypatch):
        import threading

        monkeypatch.setattr("dagsync.transactions.BUSY_TIMEOUT_MS", 50)
        other = apsw.Connection(str(dag_file))
        other.execute("BEGIN IMMEDIATE")
        released = threading.Timer(0.5, lambda: other.execute("COMMIT"))
        released.start()
        with open_target(dag_file) as db:
            db.conn.set_busy_timeout(50)
            with write_transaction(db.conn):
                db.conn.execute("UPDATE conversations SET name = name")
        released.join()
        other.close()

    def test_write_transaction_rolls_back_on_error(self, dag_file):
        with open_target(dag_file) as db:
            with pytest.raises(RuntimeError):
                with write_transaction(db.conn):
                    db.conn.execute("DELETE FROM message_parts")
                    raise RuntimeError("boom")
            assert next(iter(db.conn.execute("SELECT count(*) FROM message_parts")))[0] == 1
