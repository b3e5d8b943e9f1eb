"""Bugs a review of the merge engine found, each pinned by the case that showed it."""

from __future__ import annotations

import hashlib
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from dagsync.errors import DamagedSource, UnsupportedDatabase
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore
from tests.history import conversation_chains, integrity, logical


def text(role: str, words: str) -> Message:
    return Message(role, [TextPart(words)])


class TestIdenticalIntegerRows:
    def test_identical_tool_instances_keep_merging_idempotent(self, tmp_path):
        src = tmp_path / "src.db"
        with MessageStore.open(src) as s:
            s.conn.execute("INSERT INTO responses (id, prompt) VALUES ('r1', 'p')")
            for i in (1, 2):  # one toolbox, run twice: two equal rows
                s.conn.execute(
                    "INSERT INTO tool_instances (id, plugin, name, arguments) VALUES (?, 'llm-tools-python', 'Python', '{}')",
                    (i,),
                )
                s.conn.execute(
                    "INSERT INTO tool_results (response_id, name, output, instance_id) VALUES ('r1', 'run', ?, ?)",
                    (f"out{i}", i),
                )
        target = tmp_path / "t.db"
        merge(target, [src])
        assert [merge(target, [src]).sources[0].written for _ in range(2)] == [0, 0]
        with sqlite3.connect(target) as conn:
            assert conn.execute("SELECT output, instance_id FROM tool_results ORDER BY id").fetchall() == [
                ("out1", 1),
                ("out2", 2),
            ]

    def test_a_merge_cut_short_between_equal_rows_copies_only_the_rest(self, tmp_path):
        src = tmp_path / "src.db"
        with MessageStore.open(src) as s:
            s.conn.execute("INSERT INTO responses (id, prompt) VALUES ('r1', 'what time is it, twice?')")
            for _ in range(2):  # get_time() called twice, no tool_call_id
                s.conn.execute("INSERT INTO tool_calls (response_id, name, arguments) VALUES ('r1', 'get_time', '{}')")
        target = tmp_path / "t.db"
        merge(target, [src])
        with sqlite3.connect(target) as conn:  # as if killed after the first row's commit
            conn.execute("DELETE FROM tool_calls WHERE id = (SELECT max(id) FROM tool_calls)")
        # (A merge killed there has recorded no marks yet, so its re-run reads the source whole.)
        merge(target, [src], full=True)
        with sqlite3.connect(target) as conn:
            assert conn.execute("SELECT count(*) FROM tool_calls").fetchone() == (2,)

    def test_non_positive_source_ids_are_not_confused_with_target_rows(self, tmp_path):
        target, src = tmp_path / "t.db", tmp_path / "s.db"
        for path, tool_id, name in ((target, 1, "A"), (src, -1, "B")):
            with MessageStore.open(path) as s:
                s.conn.execute("INSERT INTO responses (id, prompt) VALUES ('r', 'p')")
                s.conn.execute("INSERT INTO tools (id, hash, name) VALUES (?, ?, ?)", (tool_id, f"hash-{name}", name))
                s.conn.execute(
                    "INSERT INTO tool_calls (response_id, tool_id, name, arguments) VALUES ('r', ?, 'f', '{}')",
                    (tool_id,),
                )
        merge(target, [src])
        with sqlite3.connect(target) as conn:
            names = conn.execute("SELECT t.name FROM tool_calls c JOIN tools t ON t.id = c.tool_id ORDER BY 1").fetchall()
        assert names == [("A",), ("B",)]


class TestForksAcrossMerges:
    def test_three_files_in_any_order_give_the_same_conversations(self, tmp_path):
        base = tmp_path / "base.db"
        with MessageStore.open(base) as s:
            conversation = s.start_conversation("plans", "m")
            s.advance_conversation(conversation, s.save_chain([text("user", "q")]))

        def grow(path: Path, start: Path, words: list[str]) -> Path:
            shutil.copyfile(start, path)
            with MessageStore.open(path) as s:
                head = s.conversation_head(conversation)
                for i, w in enumerate(words):
                    head = s.save_chain([text("assistant" if i % 2 == 0 else "user", w)], head)
                s.advance_conversation(conversation, head)
            return path

        a = grow(tmp_path / "a.db", base, ["yes"])
        b = grow(tmp_path / "b.db", base, ["no"])
        c = grow(tmp_path / "c.db", b, ["why not?", "because"])  # b, one turn later
        results = []
        for order in ([a, b, c], [b, c, a], [a, c, b], [c, a, b]):
            target = tmp_path / ("t-" + "".join(p.stem for p in order) + ".db")
            merge(target, order)
            assert integrity(target) == []
            results.append((logical(target), sorted(len(v) for v in conversation_chains(target).values())))
        assert all(r == results[0] for r in results)
        assert results[0][1] == [2, 4]  # a's head, and c's (b's fast-forwarded), no stale fork


class TestLiveWriters:
    def test_rows_written_into_the_source_during_a_merge_wait_for_the_next(self, tmp_path):
        src, target = tmp_path / "laptop.db", tmp_path / "server.db"
        with MessageStore.open(src) as s:
            conversation = s.start_conversation("c", "m")
            head = s.save_chain([text("user", "q")])
            s.advance_conversation(conversation, head)
            s.record_call(model="m", head_input_message_id=head, head_output_message_id=None, conversation_id=conversation)
        MessageStore.open(target).close()
        wrote = []

        def llm_writes_the_source(phase, done, total):
            if phase == "planned" and not wrote:
                wrote.append(True)
                with MessageStore.open(src) as s:
                    live = s.save_chain([text("user", "live turn")])
                    s.record_call(model="m", head_input_message_id=live, head_output_message_id=None, call_id="01live")
                    s.start_conversation("live", "m", live)

        merge(target, [src], progress=llm_writes_the_source)
        assert integrity(target) == []
        with sqlite3.connect(target) as conn:
            assert conn.execute("SELECT count(*) FROM calls WHERE head_input_message_id IS NULL").fetchone() == (0,)
        second = merge(target, [src])  # the live rows arrive whole, next time
        assert second.sources[0].table("calls").added == 1
        with sqlite3.connect(target) as conn:
            assert conn.execute("SELECT head_input_message_id IS NOT NULL FROM calls WHERE id = '01live'").fetchone() == (1,)

    def test_a_head_moved_in_the_source_during_a_merge_never_dangles(self, tmp_path):
        # The conversation row is inside the plan's snapshot, but the message
        # its head moved to is not: the copied row must not point at it.
        src, target = tmp_path / "laptop.db", tmp_path / "server.db"
        with MessageStore.open(src) as s:
            conversation = s.start_conversation("c", "m")
            s.advance_conversation(conversation, s.save_chain([text("user", "q")]))
        MessageStore.open(target).close()
        moved = []

        def llm_continues_the_conversation(phase, done, total):
            if phase == "planned" and not moved:
                with MessageStore.open(src) as s:
                    (head,) = s.conn.execute("SELECT head_message_id FROM conversations").fetchone()
                    moved.append(s.save_chain([text("assistant", "a live answer")], head))
                    s.advance_conversation(conversation, moved[0])

        merge(target, [src], progress=llm_continues_the_conversation)
        assert moved
        assert integrity(target) == []
        merge(target, [src])  # the live message arrives, and the head follows it
        assert integrity(target) == []
        with sqlite3.connect(target) as conn:
            assert conn.execute("SELECT head_message_id FROM conversations").fetchone() == (moved[0],)

    def test_a_fast_forward_overtaken_by_a_live_writer_becomes_a_fork(self, tmp_path):
        target, src = tmp_path / "server.db", tmp_path / "laptop.db"
        with MessageStore.open(target) as s:
            conversation = s.start_conversation("c", "m")
            question = s.save_chain([text("user", "q")])
            s.advance_conversation(conversation, question)
        shutil.copyfile(target, src)
        with MessageStore.open(src) as s:
            s.advance_conversation(conversation, s.save_chain([text("assistant", "laptop answer")], question))
        wrote = []

        def llm_answers_on_the_server(phase, done, total):
            if phase == "planned" and not wrote:
                wrote.append(True)
                with MessageStore.open(target) as s:
                    s.advance_conversation(conversation, s.save_chain([text("assistant", "server answer")], question))

        report = merge(target, [src], progress=llm_answers_on_the_server)
        assert report.sources[0].table("conversations").forked == 1
        answers = {
            tuple(m.parts[0].text for m in MessageStore.open(target).load_chain(h)) if h else ()
            for h in conversation_chains_heads(target)
        }
        assert ("q", "laptop answer") in answers and ("q", "server answer") in answers
        assert merge(target, [src]).sources[0].written == 0


def conversation_chains_heads(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [h for (h,) in conn.execute("SELECT head_message_id FROM conversations")]


class TestNotConflicts:
    def test_the_same_attachment_read_from_different_paths(self, tmp_path):
        attachment = hashlib.sha256(b"the same image bytes").hexdigest()
        for name, path in (("laptop", "/home/ann/cat.png"), ("desktop", "/Users/ann/cat.png")):
            with MessageStore.open(tmp_path / f"{name}.db") as s:
                s.conn.execute(
                    "INSERT INTO attachments (id, type, path) VALUES (?, 'image/png', ?)", (attachment, path)
                )
                s.conn.execute("INSERT INTO responses (id, prompt) VALUES (?, 'describe')", (f"r-{name}",))
                s.conn.execute("INSERT INTO prompt_attachments VALUES (?, ?, 0)", (f"r-{name}", attachment))
        merge(tmp_path / "laptop.db", [tmp_path / "desktop.db"])
        with sqlite3.connect(tmp_path / "laptop.db") as conn:
            assert conn.execute("SELECT count(*) FROM prompt_attachments").fetchone() == (2,)
            assert conn.execute("SELECT path FROM attachments").fetchall() == [("/home/ann/cat.png",)]


class TestRefusals:
    def test_a_dag_source_with_a_newer_migration(self, tmp_path):
        older, newer = tmp_path / "older.db", tmp_path / "newer.db"
        MessageStore.open(older).close()
        MessageStore.open(newer).close()
        with sqlite3.connect(newer) as conn:
            conn.execute("INSERT INTO _llm_migrations VALUES ('m024_turn_labels', 'x')")
        with pytest.raises(UnsupportedDatabase, match="it has migration\\(s\\) m024_turn_labels that"):
            merge(older, [newer])

    def test_the_branch_s_own_names_for_known_migrations_are_fine(self, tmp_path):
        ours, branch = tmp_path / "ours.db", tmp_path / "branch.db"
        MessageStore.open(ours).close()
        MessageStore.open(branch).close()
        with sqlite3.connect(branch) as conn:
            conn.execute("UPDATE _llm_migrations SET name = 'm023_dag_messages' WHERE name LIKE 'm023%'")
        merge(ours, [branch])

    def test_an_integer_id_that_is_not_the_rowid(self, tmp_path):
        src = tmp_path / "src.db"
        MessageStore.open(src).close()
        with sqlite3.connect(src) as conn:
            conn.execute("DROP TABLE tool_instances")
            conn.execute("CREATE TABLE tool_instances (id INTEGER, plugin TEXT, name TEXT, arguments TEXT)")
        with pytest.raises(UnsupportedDatabase) as info:
            merge(tmp_path / "t.db", [src])
        assert str(info.value) == (
            f"{src}: 'tool_instances.id' is not an INTEGER PRIMARY KEY as llm makes it; "
            "dagsync refused the file without reading it"
        )


class TestLlmFormatDamage:
    """Hash-keyed messages skip the mapping rounds when nothing is odd; damage must still be named."""

    def llm_file(self, path: Path, rows: list[tuple[str, str | None]]) -> Path:
        import apsw

        from dagsync.formats.llm import LLM

        conn = apsw.Connection(str(path))
        conn.execute(LLM.schema_sql)
        conn.executemany("INSERT INTO _llm_migrations VALUES (?, 'x')", [(m,) for m in LLM.migrations])
        conn.executemany("INSERT INTO messages (hash, parent_hash, role) VALUES (?, ?, 'user')", rows)
        conn.close()
        return path

    def test_a_dangling_parent(self, tmp_path):
        src = self.llm_file(tmp_path / "s.db", [("b2:a", None), ("b2:orphan", "b2:gone")])
        with pytest.raises(DamagedSource, match="a parent that does not exist; for example message b2:orphan"):
            merge(tmp_path / "t.db", [src])

    def test_a_cycle(self, tmp_path):
        src = self.llm_file(tmp_path / "s.db", [("b2:x", "b2:y"), ("b2:y", "b2:x")])
        with pytest.raises(DamagedSource, match="a cycle in the parent links"):
            merge(tmp_path / "t.db", [src])

    def test_a_part_of_a_message_the_source_does_not_have(self, tmp_path):
        # Counted in the pass that maps the parts (plan_integer_unique), then named.
        src = self.llm_file(tmp_path / "s.db", [("b2:a", None)])
        with sqlite3.connect(src) as conn:
            conn.execute("INSERT INTO parts (id, message_hash, position, type, text) VALUES (1, 'b2:a', 0, 'text', 'hi')")
            conn.execute("INSERT INTO parts (id, message_hash, position, type, text) VALUES (2, 'b2:gone', 0, 'text', 'x')")
        target = tmp_path / "t.db"
        with pytest.raises(DamagedSource) as info:
            merge(target, [src])
        assert str(info.value) == (
            f"{src}: parts.message_hash refers to messages 'b2:gone', which s.db does not have; "
            "nothing was merged - run `dagsync verify` on the source"
        )
        assert not target.exists()

    def test_children_stored_before_their_parents(self, tmp_path):
        from dagsync.merkle import message_hash

        parent = message_hash({"role": "user", "parts": []}, None)
        child = message_hash({"role": "user", "parts": []}, parent)
        src = self.llm_file(tmp_path / "s.db", [(child, parent), (parent, None)])
        merge(tmp_path / "t.db", [src])
        assert integrity_llm(tmp_path / "t.db") == []


def integrity_llm(path: Path) -> list:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT hash FROM messages m WHERE parent_hash IS NOT NULL AND NOT EXISTS "
            "(SELECT 1 FROM messages p WHERE p.hash = m.parent_hash)"
        ).fetchall()


class TestDerivedTables:
    """FTS indexes are never copied; the target's own triggers index what arrives,
    and where a target has lost its trigger the merged rows are indexed all the same."""

    @pytest.mark.parametrize("fmt", ["dag", "llm"])
    @pytest.mark.parametrize("trigger", [True, False], ids=["with-trigger", "trigger-dropped"])
    def test_every_merged_row_is_in_the_full_text_index(self, tmp_path, fmt, trigger):
        if fmt == "llm":
            pytest.importorskip("llm")
            from fixtures import family_llm as make

            machines = [r.path for r in make(tmp_path / "fam", seed=41, machines=2, conversations=40)]
            indexes = {"responses_fts": "responses_ai", "turn_search_fts": "turn_search_ai"}
        else:
            from fixtures import family as make

            machines = [r.path for r in make(tmp_path / "fam", seed=41, machines=2, conversations=40)]
            indexes = {"responses_fts": "responses_ai"}
        target = tmp_path / "target.db"
        shutil.copyfile(machines[0], target)
        if not trigger:
            with sqlite3.connect(target) as conn:
                for name in indexes.values():
                    conn.execute(f"DROP TRIGGER {name}")
                # A row written while the trigger was gone: the index lacks it too.
                conn.execute("INSERT INTO responses (id, prompt, response) VALUES ('by-hand', 'unindexed zebra', 'x')")
        report = merge(target, [machines[1]])
        contents = {"responses_fts": "responses", "turn_search_fts": "turn_search"}
        # llm 0.36 logs to turn_search; the dag branch to responses.
        searched = [fts for fts in indexes if report.sources[0].table(contents[fts]).added]
        assert searched == (["turn_search_fts"] if fmt == "llm" else ["responses_fts"])
        with sqlite3.connect(target) as conn:
            for fts in indexes:
                # FTS5 compares its index with the content table, row by row.
                conn.execute(f"INSERT INTO {fts}({fts}) VALUES ('integrity-check')")
            for fts in searched:
                content = contents[fts]
                rows = conn.execute(f"SELECT count(*) FROM {content}").fetchone()[0]
                # The last row, one the merge added, is found by a word of its own.
                rowid, prompt = conn.execute(
                    f"SELECT rowid, prompt FROM {content} WHERE prompt GLOB '*[A-Za-z][A-Za-z][A-Za-z]*' "
                    "ORDER BY rowid DESC LIMIT 1"
                ).fetchone()
                assert rowid > rows - report.sources[0].table(content).added
                word = re.search(r"[A-Za-z]{3,}", prompt).group()
                hits = {r for (r,) in conn.execute(f"SELECT rowid FROM {fts} WHERE {fts} MATCH ?", (f'"{word}"',))}
                assert rowid in hits, f"{content} row {rowid} of {rows} is not in {fts}"
