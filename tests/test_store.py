"""MessageStore: round trips, dedup, prefixes, forks, calls, and its errors."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import given

from dagsync.errors import HashContractError, NotFound, UnsupportedDatabase
from dagsync.message import Message, ReasoningPart, TextPart, ToolResultPart, Attachment
from dagsync.store import ROOT, MessageStore, UlidFactory
from tests.strategies import chains, messages

SYSTEM = Message("system", [TextPart("You are terse.")])


def user(text: str) -> Message:
    return Message("user", [TextPart(text)])


def assistant(text: str) -> Message:
    return Message("assistant", [TextPart(text)])


def rows(store: MessageStore) -> tuple[int, int]:
    (m,) = next(iter(store.conn.execute("SELECT count(*) FROM messages")))
    (p,) = next(iter(store.conn.execute("SELECT count(*) FROM message_parts")))
    return m, p


def chain_ids(store: MessageStore, head: str) -> list[str]:
    ids = []
    while head != ROOT:
        ids.append(head)
        (head,) = next(iter(store.conn.execute("SELECT parent_id FROM messages WHERE id = ?", (head,))))
    return ids[::-1]


@contextlib.contextmanager
def fresh_store():
    """A new store per hypothesis example: equal hashes dedup across examples, and
    an attachment part's provider_metadata is not part of its hash."""
    with tempfile.TemporaryDirectory() as d, MessageStore.open(Path(d) / "s.db") as s:
        yield s


class TestRoundTrip:
    @given(chains)
    def test_any_chain_saved_then_loaded_is_equal(self, chain):
        with fresh_store() as store:
            assert store.load_chain(store.save_chain(chain)) == chain

    @given(messages)
    def test_any_message_under_any_parent(self, message):
        with fresh_store() as store:
            parent = store.save_chain([SYSTEM])
            head = store.save_chain([message], parent)
            assert store.load_chain(head) == [SYSTEM, message]

    def test_metadata_outside_the_hash_does_not_make_a_new_row(self, store):
        from dagsync.message import AttachmentPart

        first = Message("user", [AttachmentPart(None, {"k": "v"})])
        head = store.save_chain([first])
        assert store.save_chain([Message("user", [AttachmentPart(None)])]) == head

    def test_the_two_cases_the_branch_loses(self, store):
        chain = [
            Message("assistant", [ReasoningPart("thinking", token_count=0)]),
            Message("tool", [ToolResultPart("f", "out", "c1", attachments=[Attachment("image/png", content=b"\x89PNG")])]),
        ]
        assert store.load_chain(store.save_chain(chain)) == chain

    def test_root_loads_as_the_empty_chain(self, store):
        assert store.load_chain(ROOT) == []


class TestDedup:
    @given(chains)
    def test_resaving_writes_no_rows(self, store, chain):
        head = store.save_chain(chain)
        before = rows(store)
        assert store.save_chain(chain) == head
        assert rows(store) == before

    @given(chains, chains)
    def test_a_chain_under_an_existing_prefix_reuses_it(self, prefix, tail):
        with fresh_store() as store:
            prefix_head = store.save_chain(prefix)
            prefix_ids = chain_ids(store, prefix_head)
            before = rows(store)[0]
            head = store.save_chain(prefix + tail)
            assert chain_ids(store, head)[: len(prefix)] == prefix_ids
            assert rows(store)[0] - before <= len(tail)
            assert store.load_chain(head) == prefix + tail

    def test_a_shared_system_prompt_is_one_row(self, store):
        a = store.save_chain([SYSTEM, user("a")])
        b = store.save_chain([SYSTEM, user("b")])
        assert chain_ids(store, a)[0] == chain_ids(store, b)[0]
        assert rows(store)[0] == 1 + 3  # the sentinel, the system prompt, two questions

    def test_same_content_under_another_parent_is_another_row(self, store):
        a = store.save_chain([user("q"), assistant("yes")])
        b = store.save_chain([user("other"), assistant("yes")])
        assert a != b

    def test_save_with_dedup_writes_only_the_unseen_tail(self, store):
        history = [SYSTEM, user("q1"), assistant("a1")]
        store.save_chain(history)
        before = rows(store)
        head = store.save_with_dedup(history + [user("q2")])
        assert rows(store)[0] == before[0] + 1
        assert store.load_chain(head) == history + [user("q2")]


class TestLongestPrefix:
    def test_nothing_matched_is_the_root(self, store):
        assert store.find_longest_existing_prefix([user("new")]) == (ROOT, 0)

    def test_partial_and_full_matches(self, store):
        head = store.save_chain([SYSTEM, user("q"), assistant("a")])
        ids = chain_ids(store, head)
        assert store.find_longest_existing_prefix([SYSTEM, user("q"), user("x")]) == (ids[1], 2)
        assert store.find_longest_existing_prefix([SYSTEM, user("q"), assistant("a")]) == (head, 3)

    def test_a_prefix_must_start_at_the_root(self, store):
        store.save_chain([SYSTEM, user("q")])
        assert store.find_longest_existing_prefix([user("q")]) == (ROOT, 0)


class TestFork:
    def test_fork_points_a_new_conversation_at_the_message(self, store):
        head = store.save_chain([SYSTEM, user("q"), assistant("a")])
        point = chain_ids(store, head)[1]
        conversation = store.fork(point, name="try again")
        assert store.conversation_head(conversation) == point
        other = store.save_chain([assistant("b")], point)
        store.advance_conversation(conversation, other)
        assert store.load_chain(other) == [SYSTEM, user("q"), assistant("b")]
        assert chain_ids(store, other)[:2] == chain_ids(store, head)[:2]

    def test_fork_takes_the_model_of_the_call_that_ended_there(self, store):
        head = store.save_chain([user("q"), assistant("a")])
        store.record_call(model="gpt-x", head_input_message_id=chain_ids(store, head)[0], head_output_message_id=head)
        conversation = store.fork(head)
        assert next(iter(store.conn.execute("SELECT model FROM conversations WHERE id = ?", (conversation,))))[0] == "gpt-x"

    def test_fork_of_a_missing_message(self, store):
        with pytest.raises(NotFound) as info:
            store.fork("nope")
        assert str(info.value) == f"no message with id 'nope' in {store.db.path}"


class TestCallsAndConversations:
    def test_a_call_records_heads_timing_usage_and_error(self, store):
        conversation = store.start_conversation("c", "m")
        input_head = store.save_chain([user("q")])
        output_head = store.save_chain([assistant("a"), assistant("b")], input_head)
        call = store.record_call(
            model="m", head_input_message_id=input_head, head_output_message_id=output_head,
            conversation_id=conversation, started_at="2026-01-01T00:00:00Z", duration_ms=12,
            input_tokens=3, output_tokens=4, token_details={"cached": 1},
        )  # fmt: skip
        row = next(iter(store.conn.execute(
            "SELECT conversation_id, head_input_message_id, head_output_message_id, model, started_at, "
            "duration_ms, input_tokens, output_tokens, token_details_json, error FROM calls WHERE id = ?", (call,))))  # fmt: skip
        assert row == (conversation, input_head, output_head, "m", "2026-01-01T00:00:00Z", 12, 3, 4, '{"cached": 1}', None)

    def test_a_failed_call_has_no_output(self, store):
        input_head = store.save_chain([user("q")])
        call = store.record_call(model="m", head_input_message_id=input_head, head_output_message_id=None, error="429")
        assert next(iter(store.conn.execute("SELECT head_output_message_id, error FROM calls WHERE id = ?", (call,)))) == (None, "429")

    def test_a_call_to_a_missing_head_is_refused(self, store):
        with pytest.raises(NotFound):
            store.record_call(model="m", head_input_message_id="nope", head_output_message_id=None)
        assert rows(store) == (1, 0)

    def test_advancing_a_conversation(self, store):
        conversation = store.start_conversation()
        assert store.conversation_head(conversation) is None
        head = store.save_chain([user("q")])
        store.advance_conversation(conversation, head)
        assert store.conversation_head(conversation) == head

    def test_advancing_a_missing_conversation(self, store):
        with pytest.raises(NotFound) as info:
            store.advance_conversation("nope", ROOT)
        assert str(info.value) == f"no conversation with id 'nope' in {store.db.path}"


class TestRefusals:
    def test_a_float_in_metadata_writes_nothing(self, store):
        with pytest.raises(HashContractError):
            store.save_chain([user("fine"), Message("assistant", [TextPart("x")], {"t": 0.7})])
        assert rows(store) == (1, 0)

    def test_saving_under_a_missing_parent(self, store):
        with pytest.raises(NotFound):
            store.save_chain([user("q")], "nope")

    def test_loading_a_missing_head(self, store):
        with pytest.raises(NotFound) as info:
            store.load_chain("nope")
        assert str(info.value) == f"no message with id 'nope' in {store.db.path}"

    def test_loading_through_a_dangling_parent(self, store):
        store.conn.execute(
            "INSERT INTO messages VALUES ('m1', 'gone', 'h', 'user', NULL, '2026-01-01T00:00:00Z')"
        )
        with pytest.raises(NotFound) as info:
            store.load_chain("m1")
        assert str(info.value) == f"message 'm1' in {store.db.path} points at parent 'gone', which does not exist"

    def test_loading_through_a_cycle(self, store, monkeypatch):
        monkeypatch.setattr("dagsync.store.MAX_CHAIN", 50)
        store.conn.execute(
            "INSERT INTO messages VALUES ('a', 'b', 'h1', 'user', NULL, 'x'), ('b', 'a', 'h2', 'user', NULL, 'x')"
        )
        with pytest.raises(UnsupportedDatabase, match="form a cycle"):
            store.load_chain("a")

    def test_the_store_refuses_an_llm_format_file(self, tmp_path):
        path = tmp_path / "logs.db"
        import apsw

        conn = apsw.Connection(str(path))
        from dagsync.formats.llm import LLM

        conn.execute(LLM.schema_sql)
        conn.close()
        with pytest.raises(UnsupportedDatabase) as info:
            MessageStore.open(path)
        assert str(info.value) == f"{path} is in the llm format; MessageStore reads and writes the dag format only"


class TestFiles:
    def test_a_new_store_is_owner_only_with_the_sentinel(self, tmp_path):
        path = tmp_path / "new.db"
        with MessageStore.open(path) as store:
            assert os.stat(path).st_mode & 0o777 == 0o600
            assert list(store.conn.execute("SELECT id, parent_id, content_hash, role FROM messages")) == [
                ("root", "root", "", "root")
            ]

    def test_wal_sidecars_are_owner_only_too(self, tmp_path):
        path = tmp_path / "wal.db"
        with MessageStore.open(path) as store:
            store.conn.execute("PRAGMA journal_mode = WAL")
            store.save_chain([user("q")])
            for suffix in ("-wal", "-shm"):
                assert os.stat(f"{path}{suffix}").st_mode & 0o777 == 0o600

    def test_an_llm_database_from_before_the_message_store_is_adopted(self, tmp_path):
        import apsw

        path = tmp_path / "old.db"
        conn = apsw.Connection(str(path))
        conn.execute(
            "CREATE TABLE _llm_migrations (name TEXT PRIMARY KEY, applied_at TEXT);"
            "CREATE TABLE conversations (id TEXT PRIMARY KEY, name TEXT, model TEXT);"
            "INSERT INTO conversations VALUES ('c1', 'old', 'gpt');"
        )
        conn.close()
        with MessageStore.open(path) as store:
            head = store.save_chain([user("q")])
            store.advance_conversation("c1", head)
            assert store.conversation_head("c1") == head

    def test_reopening_keeps_everything(self, tmp_path):
        path = tmp_path / "s.db"
        with MessageStore.open(path) as store:
            head = store.save_chain([SYSTEM, user("q")])
        with MessageStore.open(path) as store:
            assert store.load_chain(head) == [SYSTEM, user("q")]
            assert rows(store)[0] == 3


class TestUlids:
    def test_ids_are_lowercase_ulids_in_creation_order(self):
        new_id = UlidFactory()
        ids = [new_id() for _ in range(2000)]
        assert all(len(i) == 26 and i == i.lower() for i in ids)
        assert ids == sorted(ids) and len(set(ids)) == len(ids)

    def test_injected_clock_and_randomness_make_the_same_ids(self):
        def make():
            rng = random.Random(4)
            return [UlidFactory(lambda: 1_700_000_000.0, rng.randbytes)() for _ in range(3)]

        assert make() == make()
