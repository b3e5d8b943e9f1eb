"""merge for the dag format: DESIGN.md's guarantees 1-6 and 8, each with its own test."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from dagsync.canonical import row_content_hash
from dagsync.errors import DamagedSource, MergeConflict, NotADatabase, UnsupportedDatabase
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore
from fixtures import family
from tests.history import conversation_chains, contains, integrity, logical, message_paths, union_of


@pytest.fixture(scope="module")
def laptops(tmp_path_factory) -> list[Path]:
    """Two machines that synced once, then diverged."""
    return [r.path for r in family(tmp_path_factory.mktemp("synced"), seed=21, machines=2, conversations=240)]


@pytest.fixture(scope="module")
def strangers(tmp_path_factory) -> list[Path]:
    """Two machines that never synced: the same system prompts under different ids."""
    return [
        r.path
        for r in family(tmp_path_factory.mktemp("strangers"), seed=22, machines=2, conversations=200, shared_fraction=0)
    ]


def fresh(tmp_path: Path, *sources: Path) -> Path:
    target = tmp_path / "merged.db"
    merge(target, list(sources))
    return target


class TestNoDanglingReference:
    """Guarantee 1."""

    @pytest.mark.parametrize("which", ["laptops", "strangers"])
    def test_after_merging_a_family(self, tmp_path, which, request):
        sources = request.getfixturevalue(which)
        assert integrity(fresh(tmp_path, *sources)) == []

    def test_the_shared_system_prompt_case_that_insert_or_ignore_breaks(self, tmp_path, strangers):
        # The naive merge the seed design proposed: INSERT OR IGNORE every row.
        naive = tmp_path / "naive.db"
        shutil.copyfile(strangers[0], naive)
        conn = sqlite3.connect(naive)
        conn.execute(f"ATTACH '{strangers[1]}' AS b")
        for table in ("messages", "message_parts"):
            conn.execute(f"INSERT OR IGNORE INTO {table} SELECT * FROM b.{table}")
        conn.commit()
        conn.close()
        assert any("dangling parent" in p for p in integrity(naive))  # the bug is real here
        assert integrity(fresh(tmp_path, *strangers)) == []


class TestNothingLost:
    """Guarantee 2."""

    def test_every_source_row_is_in_the_target(self, tmp_path, laptops):
        target = fresh(tmp_path, *laptops)
        assert contains(logical(target), union_of(*map(logical, laptops))) == []

    def test_every_source_conversation_loads_with_exactly_its_messages(self, tmp_path, strangers):
        target = fresh(tmp_path, *strangers)
        with MessageStore.open(target) as merged:
            kept = {cid for (cid,) in merged.conn.execute("SELECT id FROM conversations")}
            for source in strangers:
                with MessageStore.open(source) as src:
                    for conversation, head in list(src.conn.execute("SELECT id, head_message_id FROM conversations")):
                        assert conversation in kept
                        expected = src.load_chain(head or "root")
                        # Found by content: ids may differ where the target already had a message.
                        found, matched = merged.find_longest_existing_prefix(expected)
                        assert matched == len(expected)
                        assert merged.load_chain(found) == expected

    def test_a_mapped_message_is_recorded_and_resolves(self, tmp_path, strangers):
        target = fresh(tmp_path, *strangers)
        conn = sqlite3.connect(target)
        rows = conn.execute("SELECT source_id, target_id FROM _dagsync_message_map").fetchall()
        assert rows, "strangers share system prompts, so some messages must be mapped"
        second = message_paths(strangers[1])
        merged = message_paths(target)
        for source_id, target_id in rows:
            assert second[source_id] == merged[target_id]
            assert conn.execute("SELECT 1 FROM messages WHERE id = ?", (source_id,)).fetchone() is None


class TestIdempotent:
    """Guarantee 3."""

    def test_a_second_merge_writes_nothing(self, tmp_path, laptops):
        target = fresh(tmp_path, *laptops)
        before = target.read_bytes()
        report = merge(target, laptops)
        assert [s.written for s in report.sources] == [0, 0]
        assert target.read_bytes() == before

    def test_merging_a_source_into_itself_is_refused(self, laptops):
        with pytest.raises(Exception, match="is the target itself"):
            merge(laptops[0], [laptops[0]])


class TestOrderIndependent:
    """Guarantee 4."""

    def test_a_into_b_and_b_into_a_hold_the_same_history(self, tmp_path, laptops):
        ab = tmp_path / "ab.db"
        ba = tmp_path / "ba.db"
        merge(ab, [laptops[0], laptops[1]])
        merge(ba, [laptops[1], laptops[0]])
        assert logical(ab) == logical(ba)

    def test_merging_into_an_existing_file_matches_merging_into_a_new_one(self, tmp_path, laptops):
        into = tmp_path / "into.db"
        shutil.copyfile(laptops[0], into)
        merge(into, [laptops[1]])
        assert logical(into) == logical(fresh(tmp_path, *laptops))


class TestSourcesAreReadOnlyAndUntrusted:
    """Guarantee 6: hostile or damaged sources get a clear error; the target is untouched."""

    @pytest.fixture
    def target(self, tmp_path, laptops) -> Path:
        path = tmp_path / "target.db"
        shutil.copyfile(laptops[0], path)
        return path

    @pytest.fixture
    def hostile(self, tmp_path, laptops) -> Path:
        path = tmp_path / "hostile.db"
        shutil.copyfile(laptops[1], path)
        return path

    def refused(self, target: Path, source: Path, error) -> str:
        before = target.read_bytes()
        with pytest.raises(error) as info:
            merge(target, [source])
        assert target.read_bytes() == before
        return str(info.value)

    def test_sources_are_never_written(self, tmp_path, laptops):
        copies = []
        for source in laptops:
            copies.append((source, source.read_bytes(), os.stat(source).st_mtime_ns))
        fresh(tmp_path, *laptops)
        for source, data, mtime in copies:
            assert source.read_bytes() == data and os.stat(source).st_mtime_ns == mtime

    def test_a_truncated_source(self, target, hostile):
        with open(hostile, "r+b") as f:
            f.truncate(hostile.stat().st_size // 3)
        assert "is truncated" in self.refused(target, hostile, NotADatabase)

    @staticmethod
    def damage(path: Path) -> None:
        """Overwrite a page in the middle of the file (table data, not the schema) with garbage."""
        page = 4096
        with open(path, "r+b") as f:
            f.seek((path.stat().st_size // page // 2) * page)
            f.write(b"\xff" * page)

    def test_a_damaged_page(self, target, hostile):
        # quick_check runs beside the plan; the merge waits for it before writing.
        self.damage(hostile)
        message = self.refused(target, hostile, NotADatabase)
        assert message.startswith(f"{hostile} is damaged: PRAGMA quick_check says: ")
        assert message.endswith(f"; restore it from a backup, or recover a copy with `sqlite3 {hostile} .recover`")

    def test_a_damaged_later_source_stops_the_merge_before_the_first_is_written(self, target, hostile, laptops):
        self.damage(hostile)
        good = target.with_name("good.db")
        shutil.copyfile(laptops[1], good)
        before = target.read_bytes()
        with pytest.raises(NotADatabase, match="is damaged: PRAGMA quick_check says"):
            merge(target, [good, hostile])
        assert target.read_bytes() == before

    def test_a_view_posing_as_a_table(self, target, hostile):
        with sqlite3.connect(hostile) as conn:
            conn.execute("DROP TABLE calls")
            conn.execute("CREATE VIEW calls AS SELECT * FROM conversations")
        assert "'calls' is a view, not a table" in self.refused(target, hostile, UnsupportedDatabase)

    def test_a_trigger(self, target, hostile):
        with sqlite3.connect(hostile) as conn:
            conn.execute("CREATE TRIGGER t AFTER INSERT ON messages BEGIN DELETE FROM calls; END")
        assert "trigger 't' on table 'messages' is not one llm creates" in self.refused(target, hostile, UnsupportedDatabase)

    def test_a_parent_cycle(self, target, hostile):
        with sqlite3.connect(hostile) as conn:
            conn.execute("DROP INDEX idx_messages_parent_hash_unique")
            conn.execute("INSERT INTO messages VALUES ('c1', 'c2', 'h1', 'user', NULL, 'x'), ('c2', 'c1', 'h2', 'user', NULL, 'x')")
        message = self.refused(target, hostile, DamagedSource)
        assert message == (
            f"{hostile}: 2 message(s) do not lead back to the root (a cycle in the parent links; "
            "for example message c1 has parent c2); nothing was merged - run `dagsync verify` on the source"
        )

    def test_a_dangling_parent(self, target, hostile):
        with sqlite3.connect(hostile) as conn:
            conn.execute("INSERT INTO messages VALUES ('orphan', 'gone', 'h1', 'user', NULL, 'x')")
        message = self.refused(target, hostile, DamagedSource)
        assert message == (
            f"{hostile}: 1 message(s) do not lead back to the root (a parent that does not exist; "
            "for example message orphan has parent gone); nothing was merged - run `dagsync verify` on the source"
        )

    def test_a_dangling_reference_in_another_table(self, target, hostile):
        with sqlite3.connect(hostile) as conn:
            conn.execute("UPDATE calls SET head_input_message_id = 'gone' WHERE rowid = (SELECT max(rowid) FROM calls)")
        message = self.refused(target, hostile, DamagedSource)
        assert message == (
            f"{hostile}: calls.head_input_message_id refers to messages 'gone', which hostile.db does not have; "
            "nothing was merged - run `dagsync verify` on the source"
        )

    def test_a_reference_neither_file_has(self, target, hostile):
        # Counted in the pass that compares the rows (plan_keyed), then named.
        with sqlite3.connect(hostile) as conn:
            conn.execute("UPDATE responses SET conversation_id = 'nowhere' WHERE rowid = (SELECT max(rowid) FROM responses)")
        message = self.refused(target, hostile, DamagedSource)
        assert message == (
            f"{hostile}: responses.conversation_id refers to conversations 'nowhere', which neither file has; "
            "nothing was merged - run `dagsync verify` on the source"
        )

    def test_an_id_conflict_lists_the_keys(self, target, hostile, laptops):
        with sqlite3.connect(hostile) as conn:
            (call_id,) = conn.execute("SELECT id FROM calls ORDER BY id LIMIT 1").fetchone()
            conn.execute("UPDATE calls SET model = 'tampered' WHERE id = ?", (call_id,))
            (mid,) = conn.execute(
                "SELECT id FROM messages WHERE id != 'root' ORDER BY id LIMIT 1"
            ).fetchone()
            conn.execute("DROP INDEX idx_messages_parent_hash_unique")
            conn.execute("UPDATE messages SET content_hash = 'ff' || substr(content_hash, 3) WHERE id = ?", (mid,))
        with pytest.raises(MergeConflict) as info:
            before = target.read_bytes()
            merge(target, [hostile])
        assert target.read_bytes() == before
        assert str(info.value).startswith(
            f"{hostile} and {target} hold different content under the same key, so nothing was merged: "
        )
        assert f"calls {call_id} differs between the two files" in info.value.conflicts
        assert any(c.startswith(f"message {mid} is (parent ") for c in info.value.conflicts)

    def test_a_call_pointing_at_another_message_is_a_conflict(self, target, hostile):
        # A reference column whose raw value differs is compared through the message map.
        with sqlite3.connect(target) as conn:
            ours = {cid for (cid,) in conn.execute("SELECT id FROM calls")}
        with sqlite3.connect(hostile) as conn:
            call_id, head = next(
                (cid, head)
                for cid, head in conn.execute("SELECT id, head_input_message_id FROM calls ORDER BY id")
                if cid in ours and head is not None
            )
            (other,) = conn.execute(
                "SELECT id FROM messages WHERE id NOT IN ('root', ?) ORDER BY id LIMIT 1", (head,)
            ).fetchone()
            conn.execute("UPDATE calls SET head_input_message_id = ? WHERE id = ?", (other, call_id))
        with pytest.raises(MergeConflict) as info:
            merge(target, [hostile])
        assert info.value.conflicts == [f"calls {call_id} differs between the two files"]

    def test_a_new_messages_part_whose_id_the_target_has(self, target, hostile):
        with sqlite3.connect(target) as conn:
            taken = {pid for (pid,) in conn.execute("SELECT id FROM message_parts")}
        with sqlite3.connect(hostile) as conn:
            theirs = {pid for (pid,) in conn.execute("SELECT id FROM message_parts")}
            part = min(taken - theirs)
            # Its content hash is right: the part's id is all that is wrong with it.
            digest = row_content_hash("user", None, [("text", "hi", None, None, None)])
            conn.execute("INSERT INTO messages VALUES ('new-one', 'root', ?, 'user', NULL, 'x')", (digest,))
            conn.execute(
                "INSERT INTO message_parts (id, message_id, \"order\", part_type, content) VALUES (?, 'new-one', 0, 'text', 'hi')",
                (part,),
            )
        before = target.read_bytes()
        with pytest.raises(MergeConflict) as info:
            merge(target, [hostile])
        assert target.read_bytes() == before
        assert f"message_parts {part} belongs to a new message but is already in the target" in info.value.conflicts

    def test_a_source_of_the_other_format(self, target, tmp_path):
        subprocess_env = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm")}
        import subprocess
        import sys

        subprocess.run([sys.executable, "-m", "llm", "-m", "echo", "hi"], env=subprocess_env, check=True, capture_output=True)
        logs = tmp_path / "llm" / "logs.db"
        assert self.refused(target, logs, UnsupportedDatabase) == (
            f"{logs} is in the llm format but {target} is in the dag format; dagsync merges files of the same format"
        )


class TestTargets:
    def test_a_new_target_is_created_owner_only(self, tmp_path, laptops):
        target = fresh(tmp_path, *laptops)
        assert target.stat().st_mode & 0o777 == 0o600

    def test_a_new_target_is_not_left_behind_when_the_first_source_is_refused(self, tmp_path, laptops):
        bad = tmp_path / "bad.db"
        bad.write_text("not a database")
        with pytest.raises(NotADatabase):
            merge(tmp_path / "new.db", [laptops[0], bad])
        assert not (tmp_path / "new.db").exists()

    def test_many_sources_in_one_command(self, tmp_path):
        reports = family(tmp_path / "three", seed=5, machines=3, conversations=60)
        target = fresh(tmp_path, *[r.path for r in reports])
        assert contains(logical(target), union_of(*(logical(r.path) for r in reports))) == []
        assert integrity(target) == []


class TestDryRun:
    def test_a_dry_run_writes_nothing_and_predicts_the_real_run(self, tmp_path, laptops):
        target = tmp_path / "t.db"
        shutil.copyfile(laptops[0], target)
        before = target.read_bytes()
        predicted = merge(target, [laptops[1]], dry_run=True)
        assert target.read_bytes() == before
        actual = merge(target, [laptops[1]])
        assert predicted.dry_run and not actual.dry_run
        assert predicted.sources == actual.sources

    def test_a_dry_run_into_a_missing_target_creates_nothing(self, tmp_path, laptops):
        report = merge(tmp_path / "new.db", laptops, dry_run=True)
        assert not (tmp_path / "new.db").exists()
        assert report.created and report.sources[0].table("messages").added > 0


class TestForks:
    @staticmethod
    def diverged(tmp_path):
        """a.db and b.db continue one conversation; b's answer is stored last."""
        base = tmp_path / "base.db"
        with MessageStore.open(base) as store:
            conversation = store.start_conversation("plans", "m")
            head = store.save_chain([Message("user", [TextPart("q")])])
            store.advance_conversation(conversation, head)
        a, b = tmp_path / "a.db", tmp_path / "b.db"
        for path, answer in ((a, "yes"), (b, "no")):
            shutil.copyfile(base, path)
            with MessageStore.open(path) as store:
                store.advance_conversation(conversation, store.save_chain([Message("assistant", [TextPart(answer)])], head))
        return a, b, conversation

    @pytest.mark.parametrize("target", ["a", "b"])
    def test_the_branch_continued_last_keeps_the_conversation_whichever_file_is_the_target(self, tmp_path, target):
        a, b, conversation = self.diverged(tmp_path)
        into, source = (a, b) if target == "a" else (b, a)
        report = merge(into, [source])
        assert report.sources[0].table("conversations").forked == 1
        (fork,) = report.sources[0].forks
        assert (fork.original, fork.side) == (conversation, "target" if target == "a" else "source")
        with sqlite3.connect(into) as conn:
            (fork_id, name) = conn.execute("SELECT id, name FROM conversations WHERE id != ?", (conversation,)).fetchone()
        assert (fork_id, name) == (fork.fork, "plans (branch from a)") == (fork.fork, fork.name)
        assert fork_id < conversation  # llm -c, which takes the highest id, never picks the fork
        with MessageStore.open(into) as store:
            assert store.load_chain(store.conversation_head(conversation))[-1].parts[0].text == "no"
            assert store.load_chain(store.conversation_head(fork_id))[-1].parts[0].text == "yes"
        assert merge(into, [source]).sources[0].written == 0  # the fork is not added twice

    def test_either_order_gives_the_same_conversations(self, tmp_path):
        a, b, _ = self.diverged(tmp_path)
        # Each file keeps its name (fork names come from it): a's copy takes b, b's copy takes a.
        (tmp_path / "x").mkdir()
        (tmp_path / "y").mkdir()
        ab, ba = tmp_path / "x" / "a.db", tmp_path / "y" / "b.db"
        shutil.copyfile(a, ab)
        shutil.copyfile(b, ba)
        merge(ab, [b])
        merge(ba, [a])
        rows = "SELECT * FROM conversations ORDER BY id"
        with sqlite3.connect(ab) as x, sqlite3.connect(ba) as y:
            assert x.execute(rows).fetchall() == y.execute(rows).fetchall()

    def test_a_head_that_moved_ahead_fast_forwards(self, tmp_path):
        a = tmp_path / "a.db"
        with MessageStore.open(a) as store:
            conversation = store.start_conversation("c", "m")
            head = store.save_chain([Message("user", [TextPart("q")])])
            store.advance_conversation(conversation, head)
        b = tmp_path / "b.db"
        shutil.copyfile(a, b)
        with MessageStore.open(b) as store:
            later = store.save_chain([Message("assistant", [TextPart("a")])], head)
            store.advance_conversation(conversation, later)
        report = merge(a, [b])
        assert report.sources[0].table("conversations").updated == 1
        assert conversation_chains(a)[conversation] == conversation_chains(b)[conversation]
        # And the other way round the target is ahead: nothing changes.
        assert merge(b, [a]).sources[0].written == 0


class TestIntegerKeys:
    def test_the_same_id_with_different_content_becomes_two_rows(self, tmp_path):
        paths = []
        for name, text in (("a", "first fragment"), ("b", "second fragment")):
            path = tmp_path / f"{name}.db"
            with MessageStore.open(path) as store:
                store.conn.execute(
                    "INSERT INTO fragments (id, hash, content, datetime_utc, source) VALUES (1, ?, ?, 'now', '-')",
                    (hashlib.sha256(text.encode()).hexdigest(), text),
                )
                store.conn.execute("INSERT INTO responses (id, prompt) VALUES (?, 'p')", (f"r-{name}",))
                store.conn.execute("INSERT INTO prompt_fragments VALUES (?, 1, 0)", (f"r-{name}",))
            paths.append(path)
        merge(paths[0], [paths[1]])
        with sqlite3.connect(paths[0]) as conn:
            rows = conn.execute(
                "SELECT p.response_id, f.content FROM prompt_fragments p JOIN fragments f ON f.id = p.fragment_id "
                "ORDER BY 1"
            ).fetchall()
        assert rows == [("r-a", "first fragment"), ("r-b", "second fragment")]
        assert merge(paths[0], [paths[1]]).sources[0].written == 0
