"""gc: deletes exactly what no root reaches past the grace period, and nothing else."""

from __future__ import annotations

import json
import shutil
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from dagsync.canonical import content_hash
from dagsync.cli import app
from dagsync.db import open_target
from dagsync.errors import DagsyncError
from dagsync.formats.llm import LLM
from dagsync.gc import _Gc, gc, parse_grace
from dagsync.merkle import message_hash
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore, part_row
from dagsync.verify import verify
from fixtures import generate, generate_llm

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()
DAY = 86400.0


def spelled(when: float, spelling: str) -> str:
    """A created_at in one of the dag format's two spellings."""
    moment = datetime.fromtimestamp(when, timezone.utc)
    if spelling == "iso":
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(moment)  # the branch's str(datetime): 2026-11-30 07:04:05.264975+00:00


OLD = {"old-iso": spelled(NOW - 3 * DAY, "iso"), "old-branch": spelled(NOW - 3 * DAY + 0.25, "branch")}
NEW = {"new-iso": spelled(NOW - 3600, "iso"), "new-branch": spelled(NOW - 3600 + 0.5, "branch"), "unreadable": "yesterday"}


# -- building databases by hand ------------------------------------------------


def dag_db(path: Path, nodes: list[tuple[str, str, str]], heads: dict[str, str], calls: list[tuple[str, str]]) -> Path:
    """A dag file: messages (id, parent id, created_at) each with one text part;
    conversations id -> head; calls (input head, output head)."""
    MessageStore.open(path).close()
    conn = sqlite3.connect(path)
    for mid, parent, created_at in nodes:
        m = Message("user", [TextPart(f"text of {mid}")])
        conn.execute(
            "INSERT INTO messages VALUES (?, ?, ?, 'user', NULL, ?)", (mid, parent, content_hash(m), created_at)
        )
        conn.execute("INSERT INTO message_parts VALUES (?, ?, 0, ?, ?, ?, ?, ?)", (f"{mid}-p", mid, *part_row(m.parts[0])))
    for cid, head in heads.items():
        conn.execute("INSERT INTO conversations (id, name, model, head_message_id) VALUES (?, 'c', 'm', ?)", (cid, head))
    for n, (inp, out) in enumerate(calls):
        conn.execute(
            "INSERT INTO calls (id, conversation_id, head_input_message_id, head_output_message_id, model, started_at) "
            "VALUES (?, NULL, ?, ?, 'm', '2026-01-01T00:00:00Z')",
            (f"call-{n}", inp, out),
        )
    conn.commit()
    conn.close()
    return path


def llm_db(
    path: Path, nodes: list[tuple[str, str | None]], tips: dict[str, str], turns: list[tuple[str | None, str]],
    *, proven: bool = False,
) -> Path:
    """An llm file: messages (hash, parent hash) each with one text part ("text of NAME");
    threads id -> tip; turns (parent hash, tip hash). The keys are the names
    given, unless ``proven``: then each message gets its real key, ``llm_keys(nodes)[name]``
    (a merge proves every message it copies)."""
    keys = llm_keys(nodes) if proven else {name: name for name, _ in nodes}
    real = lambda name: None if name is None else keys.get(name, name)  # noqa: E731
    open_target(path, create=LLM).close()
    conn = sqlite3.connect(path)
    tips = {tid: real(tip) for tid, tip in tips.items()}
    turns = [(real(parent), real(tip)) for parent, tip in turns]
    for name, parent in nodes:
        h = real(name)
        conn.execute("INSERT INTO messages (hash, parent_hash, role) VALUES (?, ?, 'user')", (h, real(parent)))
        conn.execute("INSERT INTO parts (message_hash, position, type, text) VALUES (?, 0, 'text', ?)", (h, f"text of {name}"))
    for tid, tip in tips.items():
        conn.execute("INSERT INTO threads (id, name, tip_message_hash) VALUES (?, 't', ?)", (tid, tip))
    for n, (parent, tip) in enumerate(turns):
        conn.execute(
            "INSERT INTO turns (id, thread_id, parent_message_hash, tip_message_hash, model) VALUES (?, NULL, ?, ?, 'm')",
            (f"turn-{n}", parent, tip),
        )
    conn.commit()
    conn.close()
    return path


def llm_keys(nodes: list[tuple[str, str | None]]) -> dict[str, str]:
    """name -> the key llm gives the message ``llm_db`` stores for it (its parent's key in it)."""
    parents = dict(nodes)
    out: dict[str, str] = {}

    def key(name: str) -> str:
        if name not in out:
            parent = parents[name]
            message = {"role": "user", "parts": [{"type": "text", "text": f"text of {name}"}]}
            out[name] = message_hash(message, None if parent is None else key(parent))
        return out[name]

    for name, _ in nodes:
        key(name)
    return out


def keys(path: Path, sql: str) -> set:
    with sqlite3.connect(path) as conn:
        if "_dagsync_gc_seen" in sql and not conn.execute(
            "SELECT 1 FROM sqlite_schema WHERE name = '_dagsync_gc_seen'"
        ).fetchone():
            return set()  # gc makes its bookkeeping only when it has something to remember
        return {row[0] for row in conn.execute(sql)}


def ancestors(parent: dict[str, str | None], starts) -> set[str]:
    """Every message on the way from each start back to the top (the model gc is checked against)."""
    out: set[str] = set()
    for node in starts:
        while node is not None and node in parent and node not in out:
            out.add(node)
            node = parent[node]
    return out


def chains(path: Path, heads) -> dict[str, list]:
    with MessageStore.open(path) as store:
        return {h: [m.to_dict() for m in store.load_chain(h)] for h in heads}


# -- the law, by hypothesis -------------------------------------------------------


@st.composite
def dags(draw):
    """A random forest of messages with random times, and random roots into it."""
    n = draw(st.integers(1, 30))
    nodes = []
    for i in range(n):
        parent = draw(st.one_of(st.just("root"), st.sampled_from([f"m{j:02d}" for j in range(i)]) if i else st.just("root")))
        nodes.append((f"m{i:02d}", parent, draw(st.sampled_from([*OLD.values(), *NEW.values()]))))
    ids = [mid for mid, _, _ in nodes]
    heads = {f"c{k}": h for k, h in enumerate(draw(st.lists(st.sampled_from(ids), max_size=4)))}
    calls = draw(st.lists(st.tuples(st.sampled_from(["root", *ids]), st.sampled_from(ids)), max_size=3))
    return nodes, heads, calls


@given(dags())
def test_gc_deletes_exactly_the_unreachable_messages_older_than_the_grace_period(tmp_path_factory, dag):
    nodes, heads, calls = dag
    path = dag_db(tmp_path_factory.mktemp("gc") / "dag.db", nodes, heads, calls)
    parent = {mid: (None if p == "root" else p) for mid, p, _ in nodes}
    roots = {*heads.values(), *(i for i, _ in calls if i != "root"), *(o for _, o in calls)}
    young = {mid for mid, _, t in nodes if t in NEW.values()}
    kept = ancestors(parent, roots | young)
    before = chains(path, roots)

    report = gc(path, grace="1d", now=NOW)

    assert keys(path, "SELECT id FROM messages") == kept | {"root"}
    assert keys(path, "SELECT message_id FROM message_parts") == kept
    assert report.table("messages").deleted == len(nodes) - len(kept)
    assert report.unreachable == len(set(parent) - ancestors(parent, roots))
    assert chains(path, roots) == before
    assert verify(path).problems == ()
    assert gc(path, grace="1d", now=NOW).deleted == 0


@st.composite
def llm_dags(draw):
    n = draw(st.integers(1, 30))
    nodes = [
        (f"b2:{i:02d}", draw(st.one_of(st.none(), st.sampled_from([f"b2:{j:02d}" for j in range(i)]))) if i else None)
        for i in range(n)
    ]
    ids = [h for h, _ in nodes]
    tips = {f"t{k}": h for k, h in enumerate(draw(st.lists(st.sampled_from(ids), max_size=4)))}
    turns = draw(st.lists(st.tuples(st.one_of(st.none(), st.sampled_from(ids)), st.sampled_from(ids)), max_size=3))
    return nodes, tips, turns


@given(llm_dags())
def test_llm_format_unreachable_messages_wait_one_run_then_go(tmp_path_factory, dag):
    nodes, tips, turns = dag
    path = llm_db(tmp_path_factory.mktemp("gc") / "logs.db", nodes, tips, turns)
    parent = dict(nodes)
    roots = {*tips.values(), *(p for p, _ in turns if p), *(t for _, t in turns)}
    reachable = ancestors(parent, roots)
    everything = set(parent)

    first = gc(path, grace="1h", now=NOW)  # no time on the rows: only remembered
    assert keys(path, "SELECT hash FROM messages") == everything
    assert first.table("messages").waiting == len(everything - reachable)
    assert gc(path, grace="1h", now=NOW + 1800).deleted == 0  # grace not over yet
    last = gc(path, grace="1h", now=NOW + 3600)

    assert keys(path, "SELECT hash FROM messages") == reachable
    assert keys(path, "SELECT message_hash FROM parts") == reachable
    assert last.table("messages").deleted == len(everything - reachable)
    assert keys(path, "SELECT key FROM _dagsync_gc_seen") == set()


# -- roots, grace, bookkeeping -------------------------------------------------------


class TestRoots:
    def test_every_kind_of_root_keeps_its_chain(self, tmp_path):
        old = OLD["old-iso"]
        nodes = [(f"{k}{i}", "root" if i == 0 else f"{k}{i - 1}", old) for k in "abcd" for i in range(3)]
        path = dag_db(tmp_path / "d.db", nodes, heads={"conv": "a2"}, calls=[("b1", "c2")])
        report = gc(path, grace="0s", now=NOW)
        assert keys(path, "SELECT id FROM messages") == {"root", "a0", "a1", "a2", "b0", "b1", "c0", "c1", "c2"}
        assert (report.roots, report.reachable, report.unreachable) == (4, 9, 4)  # the sentinel counts; b2 and d*

    def test_the_sentinel_is_never_deleted(self, tmp_path):
        path = dag_db(tmp_path / "d.db", [("x", "root", OLD["old-iso"])], heads={}, calls=[])
        gc(path, grace="0s", now=NOW)
        assert keys(path, "SELECT id FROM messages") == {"root"}

    def test_llm_turn_parents_and_tips_and_thread_tips_are_roots(self, tmp_path):
        nodes = [("b2:a", None), ("b2:b", "b2:a"), ("b2:c", None), ("b2:d", None), ("b2:e", "b2:d")]
        path = llm_db(tmp_path / "l.db", nodes, tips={"t": "b2:b"}, turns=[("b2:c", "b2:c")])
        gc(path, grace="0s", now=NOW)
        gc(path, grace="0s", now=NOW + 1)
        assert keys(path, "SELECT hash FROM messages") == {"b2:a", "b2:b", "b2:c"}


class TestGrace:
    @pytest.mark.parametrize("spelling", sorted(NEW))
    def test_a_new_unreachable_message_is_kept_with_what_it_reaches(self, tmp_path, spelling):
        nodes = [("a", "root", OLD["old-iso"]), ("b", "a", OLD["old-branch"]), ("c", "b", NEW[spelling])]
        path = dag_db(tmp_path / "d.db", nodes, heads={}, calls=[])
        report = gc(path, grace="14d", now=NOW)
        assert keys(path, "SELECT id FROM messages") == {"root", "a", "b", "c"}
        assert (report.unreachable, report.kept_by_grace, report.deleted) == (3, 3, 0)
        assert report.table("messages").waiting == 3

    @pytest.mark.parametrize("spelling", sorted(OLD))
    def test_an_old_unreachable_message_goes_in_either_spelling(self, tmp_path, spelling):
        path = dag_db(tmp_path / "d.db", [("a", "root", OLD[spelling])], heads={}, calls=[])
        assert gc(path, grace="2d", now=NOW).table("messages").deleted == 1
        path = dag_db(tmp_path / "e.db", [("a", "root", OLD[spelling])], heads={}, calls=[])
        assert gc(path, grace="4d", now=NOW).table("messages").deleted == 0

    def test_no_grace_deletes_timeless_rows_on_the_first_run(self, tmp_path):
        """llm's rows carry no time; --grace 0s still means nothing waits."""
        path = llm_db(tmp_path / "l.db", [("b2:a", None), ("b2:b", "b2:a"), ("b2:c", None)], tips={"t": "b2:c"}, turns=[])
        report = gc(path, grace="0s", now=NOW)
        assert keys(path, "SELECT hash FROM messages") == {"b2:c"}
        assert (report.kept_by_grace, report.table("messages").deleted) == (0, 2)
        assert all(t.waiting == 0 for t in report.tables)

    def test_a_message_reachable_again_drops_out_of_the_first_seen_table(self, tmp_path):
        path = llm_db(tmp_path / "l.db", [("b2:a", None), ("b2:b", "b2:a")], tips={}, turns=[])
        gc(path, grace="1h", now=NOW)
        assert keys(path, "SELECT key FROM _dagsync_gc_seen") == {"b2:a", "b2:b"}
        with sqlite3.connect(path) as conn:
            conn.execute("INSERT INTO threads (id, tip_message_hash) VALUES ('t', 'b2:a')")
        gc(path, grace="1h", now=NOW + 1800)
        assert keys(path, "SELECT key FROM _dagsync_gc_seen") == {"b2:b"}
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM threads")
        # b2:a was seen unreachable before, but it was reachable in between:
        # its clock starts again. b2:b's has run out.
        gc(path, grace="1h", now=NOW + 3700)
        assert keys(path, "SELECT hash FROM messages") == {"b2:a"}
        assert keys(path, "SELECT key FROM _dagsync_gc_seen") == {"b2:a"}

    @pytest.mark.parametrize(
        ("text", "seconds"),
        [("0s", 0), ("90s", 90), ("30m", 1800), ("12h", 43200), ("14d", 14 * DAY), ("2w", 14 * DAY), ("1d12h", 1.5 * DAY), (" 2W ", 14 * DAY)],
    )
    def test_grace_periods_are_read(self, text, seconds):
        assert parse_grace(text) == seconds

    @pytest.mark.parametrize("text", ["", "14", "d", "1x", "-1d", "1d junk", "one day"])
    def test_a_bad_grace_period_is_refused_with_an_example(self, text):
        with pytest.raises(DagsyncError) as info:
            parse_grace(text)
        assert str(info.value) == (
            f"invalid grace period {text!r}: give a number and a unit (s, m, h, d or w), e.g. 0s, 12h, 14d or 2w"
        )


class TestSharedRows:
    """Fragments, attachments, tools: deleted when nothing references them any more."""

    @pytest.fixture
    def path(self, tmp_path) -> Path:
        nodes = [("b2:keep", None), ("b2:gone", None)]
        path = llm_db(tmp_path / "l.db", nodes, tips={"t": "b2:keep"}, turns=[])
        with sqlite3.connect(path) as conn:
            for n in range(1, 7):
                conn.execute("INSERT INTO fragments (id, hash, content) VALUES (?, ?, ?)", (n, f"h{n}", f"fragment {n}"))
            part = lambda h: conn.execute("SELECT id FROM parts WHERE message_hash = ?", (h,)).fetchone()[0]  # noqa: E731
            conn.execute("INSERT INTO part_fragments VALUES (?, 1, 0)", (part("b2:keep"),))  # a survivor's
            conn.execute("INSERT INTO part_fragments VALUES (?, 2, 0)", (part("b2:gone"),))  # only the garbage's
            conn.execute("INSERT INTO part_fragments VALUES (?, 3, 0)", (part("b2:gone"),))  # both
            conn.execute("INSERT INTO part_fragments VALUES (?, 3, 0)", (part("b2:keep"),))
            conn.execute("INSERT INTO fragment_aliases VALUES ('name', 4)")  # an alias
            # Only inside a survivor's payload, with no part_fragments row.
            conn.execute(
                "UPDATE parts SET text = NULL, payload = ? WHERE message_hash = 'b2:keep'",
                (json.dumps({"text_ref": [{"literal": "x"}, {"fragment": 5}]}),),
            )
            # 6: referenced by nothing at all.
            conn.execute("INSERT INTO attachments (id, content) VALUES ('att-gone', x'00'), ('att-keep', x'01')")
            conn.execute("INSERT INTO part_attachments VALUES (?, 'att-gone', 0)", (part("b2:gone"),))
            conn.execute("INSERT INTO part_attachments VALUES (?, 'att-keep', 0)", (part("b2:keep"),))
        return path

    def test_rows_only_deleted_messages_used_go_with_them(self, path):
        gc(path, grace="1h", now=NOW)
        second = gc(path, grace="1h", now=NOW + 3600)
        assert keys(path, "SELECT hash FROM messages") == {"b2:keep"}
        assert keys(path, "SELECT id FROM fragments") == {1, 3, 4, 5}
        assert keys(path, "SELECT id FROM attachments") == {"att-keep"}
        assert [second.table(t).deleted for t in ("messages", "parts", "part_fragments", "part_attachments")] == [1, 1, 2, 1]
        # 2 went with its message; 6 (referenced by nothing) had waited out its hour.
        assert (second.table("fragments").deleted, second.table("attachments").deleted) == (2, 1)
        with sqlite3.connect(path) as conn:  # (hand-made hashes: verify would flag them)
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []

    def test_a_row_referenced_by_nothing_waits_out_the_grace_period(self, path):
        assert gc(path, grace="1h", now=NOW).table("fragments").waiting == 1
        assert gc(path, grace="1h", now=NOW + 1800).table("fragments").deleted == 0
        report = gc(path, grace="1h", now=NOW + 3600)
        assert 6 not in keys(path, "SELECT id FROM fragments")
        assert report.table("fragments").waiting == 0

    def test_a_reference_written_after_the_mark_keeps_the_row(self, path):
        gc(path, grace="1h", now=NOW)  # seen once: old enough for the run below
        db = open_target(path)
        run = _Gc(db, 0.0, NOW + 1, False, None)
        run.mark()
        with sqlite3.connect(path) as conn:
            conn.execute("INSERT INTO turn_fragments (turn_id, fragment_id, \"order\", kind) VALUES (NULL, 2, 0, 'prompt')")
            conn.execute("INSERT INTO turn_fragments (turn_id, fragment_id, \"order\", kind) VALUES (NULL, 6, 0, 'prompt')")
        run.sweep()
        run.sweep_shared()
        run.drop_temp()
        db.close()
        assert {2, 6} <= keys(path, "SELECT id FROM fragments")
        assert keys(path, "SELECT hash FROM messages") == {"b2:keep"}


class TestWritesDuringAGc:
    """The sweep checks the file as it is, not as the mark read it."""

    def test_a_child_or_a_root_added_after_the_mark_keeps_the_chain(self, tmp_path):
        old = OLD["old-iso"]
        nodes = [(f"{k}{i}", "root" if i == 0 else f"{k}{i - 1}", old) for k in "abc" for i in range(4)]
        path = dag_db(tmp_path / "d.db", nodes, heads={}, calls=[])
        db = open_target(path)
        run = _Gc(db, 0.0, NOW, False, None)
        run.mark()
        assert run.one("SELECT count(*) FROM temp.gc_cand") == 12
        with sqlite3.connect(path) as conn:
            m = Message("user", [TextPart("new")])
            conn.execute("INSERT INTO messages VALUES ('a4', 'a3', ?, 'user', NULL, ?)", (content_hash(m), NEW["new-iso"]))
            conn.execute("INSERT INTO message_parts VALUES ('a4-p', 'a4', 0, ?, ?, ?, ?, ?)", part_row(m.parts[0]))
            conn.execute("INSERT INTO conversations (id, head_message_id) VALUES ('late', 'b1')")
        run.sweep()
        run.record()
        run.drop_temp()
        db.close()
        assert keys(path, "SELECT id FROM messages") == {"root", "a0", "a1", "a2", "a3", "a4", "b0", "b1"}
        assert run.kept_as_new == 6  # a3, a2, a1, a0; b1, b0
        assert verify(path).problems == ()


# -- whole databases ---------------------------------------------------------------


def _orphan_a_third(path: Path, remainder: int = 0) -> None:
    """Delete the roots of every third conversation or thread, as a user would."""
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        if "threads" in tables:
            gone = f"SELECT id FROM turns WHERE thread_id IN (SELECT id FROM threads WHERE rowid % 3 = {remainder})"
            for table in ("turn_search", "turn_fragments", "turn_tools", "tool_instantiations"):
                conn.execute(f"DELETE FROM {table} WHERE turn_id IN ({gone})")
            conn.execute(f"DELETE FROM turns WHERE thread_id IN (SELECT id FROM threads WHERE rowid % 3 = {remainder})")
            conn.execute(f"UPDATE threads SET forked_from = NULL WHERE forked_from IN (SELECT id FROM threads WHERE rowid % 3 = {remainder})")
            conn.execute(f"DELETE FROM threads WHERE rowid % 3 = {remainder}")
        else:
            conn.execute(f"DELETE FROM calls WHERE conversation_id IN (SELECT id FROM conversations WHERE rowid % 3 = {remainder})")
            conn.execute(f"UPDATE conversations SET head_message_id = NULL WHERE rowid % 3 = {remainder}")


@pytest.fixture(scope="module", params=["dag", "llm"])
def orphaned(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("orphaned") / f"{request.param}.db"
    (generate if request.param == "dag" else generate_llm)(path, seed=5, conversations=400)
    _orphan_a_third(path)
    if request.param == "llm":
        gc(path, grace="1h", now=1.0)  # llm rows carry no time: let gc see them once, long ago
    return path


def _comparable(report) -> dict:
    d = json.loads(json.dumps(report, default=lambda o: o.__dict__))
    for volatile in ("dry_run", "seconds", "file_bytes", "vacuum", "path"):
        d.pop(volatile)
    return d


def test_a_dry_run_reports_exactly_what_a_real_run_deletes_and_writes_nothing(orphaned, tmp_path):
    path = tmp_path / "copy.db"
    shutil.copyfile(orphaned, path)
    before = path.read_bytes()
    dry = gc(path, grace="0s", now=NOW + 10, dry_run=True)
    assert path.read_bytes() == before
    real = gc(path, grace="0s", now=NOW + 10)
    assert dry.deleted > 0 and dry.table("messages").deleted > 0
    assert _comparable(dry) == _comparable(real)
    assert verify(path).problems == ()
    again = path.read_bytes()
    assert gc(path, grace="0s", now=NOW + 20).deleted == 0
    assert path.read_bytes() == again  # a gc with nothing to do writes nothing


def test_vacuum_gives_the_space_back_then_stays_incremental(orphaned, tmp_path):
    path = tmp_path / "copy.db"
    shutil.copyfile(orphaned, path)
    first = gc(path, grace="0s", now=NOW + 10, vacuum=True)
    assert first.vacuum.mode == "full"
    assert first.vacuum.bytes_after < first.vacuum.bytes_before
    assert path.stat().st_size == first.vacuum.bytes_after
    _orphan_a_third(path, remainder=1)
    gc(path, grace="0s", now=NOW + 20)
    second = gc(path, grace="0s", now=NOW + 30, vacuum=True)
    assert second.vacuum.mode == "incremental"
    assert second.vacuum.bytes_after < second.vacuum.bytes_before
    assert verify(path).problems == ()


def test_message_map_entries_of_deleted_messages_go_too(tmp_path):
    path = dag_db(tmp_path / "d.db", [("a", "root", OLD["old-iso"]), ("b", "root", OLD["old-iso"])], {"c": "b"}, [])
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE _dagsync_message_map (source_id TEXT PRIMARY KEY, target_id TEXT NOT NULL)")
        conn.execute("INSERT INTO _dagsync_message_map VALUES ('x', 'a'), ('y', 'b')")
    gc(path, grace="0s", now=NOW)
    assert keys(path, "SELECT source_id FROM _dagsync_message_map") == {"y"}


# -- the command line ------------------------------------------------------------------

runner = CliRunner()


class TestCli:
    def test_the_report_prints_when_piped_and_quiet_silences_it(self, orphaned, tmp_path):
        path = tmp_path / "copy.db"
        shutil.copyfile(orphaned, path)
        dry = runner.invoke(app, ["gc", str(path), "--grace", "0s", "--dry-run", "--quiet"], catch_exceptions=False)
        assert dry.exit_code == 0 and dry.stdout.startswith(f"{path}: would delete ")
        result = runner.invoke(app, ["gc", str(path), "--grace", "0s", "--quiet"], catch_exceptions=False)
        assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
        assert verify(path).problems == ()
        again = runner.invoke(app, ["gc", str(path), "--grace", "0s"], catch_exceptions=False)
        assert again.exit_code == 0 and again.stdout.startswith(f"{path}: deleted 0 row(s), ")

    def test_json_report(self, orphaned, tmp_path):
        path = tmp_path / "copy.db"
        shutil.copyfile(orphaned, path)
        result = runner.invoke(app, ["gc", str(path), "--grace", "0s", "--dry-run", "--json"], catch_exceptions=False)
        assert result.exit_code == 0
        report = json.loads(result.stdout)
        assert report["dry_run"] is True and report["deleted"] > 0
        assert {t["table"] for t in report["tables"]} >= {"messages", "fragments", "attachments"}

    def test_a_bad_grace_period_is_a_usage_error(self, orphaned):
        result = runner.invoke(app, ["gc", str(orphaned), "--grace", "soon"])
        assert result.exit_code == 2
        assert result.stderr.endswith(
            "Error: Invalid value for '--grace': invalid grace period 'soon': give a number and a unit "
            "(s, m, h, d or w), e.g. 0s, 12h, 14d or 2w\n"
        )

    def test_a_missing_database_is_one_line_and_exit_1(self, tmp_path):
        result = runner.invoke(app, ["gc", str(tmp_path / "nope.db")])
        assert (result.exit_code, result.stderr) == (1, f"Error: {tmp_path / 'nope.db'}: no such file\n")
