"""The dag messages' plan: its shortcuts find what the level-by-level rounds find.

The plan settles a source's new messages in one pass once the rounds have
looked up every child of a message the target holds (``descendants.rest_new``),
when the source is in order and has no twins; else the descendants of each
round's new messages at once (``descendants.below_new``); else level by level.
Each shortcut must give, row for row, what the rounds alone give.

llm messages, keyed by their hash, are settled new in the pass that finds
what the target holds, when the source is in order; a source stored
children first takes the rounds, and ends the same.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dagsync.merge.descendants as descendants
from dagsync.errors import MergeConflict
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore

WORDS = ["hi", "yes", "no"]  # few, so that files written apart say the same things
chains = st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4), max_size=4)
grown = st.lists(st.tuples(st.integers(0, 50), st.lists(st.sampled_from(WORDS), min_size=1, max_size=4)), max_size=4)


def _save(path: Path, anchored: list[tuple[int | None, list[str]]]) -> None:
    """Save each chain under an existing message (by its rowid, modulo) or the root."""
    with MessageStore.open(path) as s:
        for anchor, words in anchored:
            ids = [i for (i,) in s.conn.execute("SELECT id FROM messages ORDER BY rowid")]
            parent = ids[anchor % len(ids)] if anchor is not None else "root"
            roles = ["user", "assistant"]
            s.save_chain([Message(roles[n % 2], [TextPart(w)]) for n, w in enumerate(words)], parent)


def _twin(path: Path, seed: int) -> None:
    """A second copy of one message and everything below it, as a source without the unique index can hold."""
    with sqlite3.connect(path) as conn:
        conn.execute("DROP INDEX IF EXISTS idx_messages_parent_hash_unique")
        ids = [i for (i,) in conn.execute("SELECT id FROM messages WHERE id != 'root' ORDER BY rowid")]
        if not ids:
            return
        original = ids[seed % len(ids)]
        below = "WITH RECURSIVE sub(id) AS (SELECT ? UNION ALL SELECT m.id FROM messages m JOIN sub ON m.parent_id = sub.id) "
        conn.execute(
            below + "INSERT INTO messages SELECT 'twin-' || id, CASE WHEN id = ? THEN parent_id ELSE 'twin-' || parent_id END, "
            "content_hash, role, provider_metadata_json, created_at FROM messages WHERE id IN sub ORDER BY rowid",
            (original, original),
        )
        conn.execute(
            below + "INSERT INTO message_parts (id, message_id, \"order\", part_type, content, content_json, tool_call_id, "
            "server_executed) SELECT 'twin-' || id, 'twin-' || message_id, \"order\", part_type, content, content_json, "
            "tool_call_id, server_executed FROM message_parts WHERE message_id IN sub ORDER BY rowid",
            (original,),
        )


def _reverse(path: Path) -> None:
    """Children stored before their parents: every message's rowid negated."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE messages SET rowid = -rowid WHERE id != 'root'")


def _rows(path: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(path) as conn:
        out = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("messages", "message_parts")}
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = '_dagsync_message_map'").fetchone():
            out["map"] = conn.execute("SELECT source_id, target_id FROM _dagsync_message_map ORDER BY 1").fetchall()
    return out


def _merge(target: Path, source: Path, *, shortcuts: str) -> tuple[dict[str, list[tuple]], tuple[int, int, int]]:
    """Merge with the plan's shortcuts: "all", "below new" (not the one pass) or "none" (the rounds)."""
    with pytest.MonkeyPatch.context() as mp:
        if shortcuts != "all":
            mp.setattr(descendants, "twins", lambda run: True)  # no one pass
        if shortcuts == "none":
            mp.setattr(descendants, "below_new", lambda run, depth: None)
        report = merge(target, [source])
    (counts,) = (t for t in report.sources[0].tables if t.table == "messages")
    return _rows(target), (counts.added, counts.mapped, counts.existing)


def _three_ways(d: Path, target: Path, source: Path) -> dict[str, object]:
    results = {}
    for shortcuts in ("all", "below new", "none"):
        copy = d / shortcuts / "t.db"  # one name: a fork is named after its file
        copy.parent.mkdir()
        shutil.copyfile(target, copy)
        results[shortcuts] = _merge(copy, source, shortcuts=shortcuts)
    return results


@settings(max_examples=40, deadline=None)
@given(base=chains, ours=grown, theirs=grown, strangers=chains, twin=st.none() | st.integers(0, 50), reverse=st.booleans())
# Found by this law: a twin of a message the target holds, with a new child (the same case as the test below).
@example(base=[["hi"]], ours=[], theirs=[(1, ["hi"])], strangers=[], twin=0, reverse=False)
def test_the_shortcuts_settle_every_message_as_the_rounds_do(base, ours, theirs, strangers, twin, reverse):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        shared, target, source = d / "shared.db", d / "target.db", d / "source.db"
        _save(shared, [(None, words) for words in base])
        shutil.copyfile(shared, target)
        shutil.copyfile(shared, source)
        _save(target, [(None, words) for words in strangers])  # said apart: mapped in a merge
        _save(target, ours)
        _save(source, [(None, words) for words in strangers])
        _save(source, theirs)
        if twin is not None:
            _twin(source, twin)
        if reverse:
            _reverse(source)
        results = _three_ways(d, target, source)
        assert results["all"] == results["below new"] == results["none"]


def _family(tmp_path: Path) -> tuple[Path, Path]:
    """A target and a source that share a prefix, each with new chains, some said apart."""
    shared, target, source = tmp_path / "shared.db", tmp_path / "target.db", tmp_path / "source.db"
    _save(shared, [(None, ["hi", "yes"]), (None, ["no"])])
    shutil.copyfile(shared, target)
    shutil.copyfile(shared, source)
    _save(target, [(1, ["no", "hi", "yes"]), (None, ["yes", "no"])])
    _save(source, [(1, ["no", "hi", "no", "yes"]), (None, ["yes", "no", "hi"]), (0, ["hi", "hi", "hi"])])
    return target, source


def test_a_source_in_order_is_settled_in_one_pass(tmp_path, monkeypatch):
    target, source = _family(tmp_path)
    calls = []
    one_pass = descendants.rest_new
    monkeypatch.setattr(descendants, "rest_new", lambda run: calls.append(1) or one_pass(run))
    results = _three_ways(tmp_path, target, source)
    assert calls == [1]
    assert results["all"] == results["below new"] == results["none"]
    added, mapped, existing = results["all"][1]
    # "no, hi" under the shared "hi", and "yes, no" under the root, were said
    # on both sides apart: mapped. What follows them in the source is new, and
    # so are "hi, hi" under the shared "hi".
    assert (added, mapped) == (5, 4)


def test_a_source_stored_children_first_is_not_settled_in_one_pass(tmp_path, monkeypatch):
    target, source = _family(tmp_path)
    _reverse(source)
    calls = []
    monkeypatch.setattr(descendants, "rest_new", lambda run: calls.append(1) or True)
    results = _three_ways(tmp_path, target, source)
    assert calls == []
    assert results["all"] == results["below new"] == results["none"]


def test_an_id_the_target_holds_deep_below_a_new_message_is_a_conflict(tmp_path):
    target, source = _family(tmp_path)
    with sqlite3.connect(source) as conn:
        # The third message of a chain only the source has.
        (deep, parent, digest) = conn.execute(
            "SELECT m.id, m.parent_id, m.content_hash FROM messages m JOIN messages p ON p.id = m.parent_id "
            "JOIN messages g ON g.id = p.parent_id WHERE g.parent_id = 'root' ORDER BY m.rowid DESC LIMIT 1"
        ).fetchone()
    with sqlite3.connect(target) as conn:
        assert not conn.execute("SELECT 1 FROM messages WHERE id IN (?, ?)", (deep, parent)).fetchone()
        theirs = "ab" * 32
        conn.execute(
            "INSERT INTO messages (id, parent_id, content_hash, role, created_at) VALUES (?, 'root', ?, 'user', 'x')",
            (deep, theirs),
        )
    before = target.read_bytes()
    with pytest.raises(MergeConflict) as info:
        merge(target, [source])
    assert target.read_bytes() == before
    assert info.value.conflicts == [
        f"message {deep} is (parent root, hash {theirs[:12]}) in the target but (parent {parent}, hash {digest[:12]}) in the source"
    ]


def test_a_twin_of_a_message_the_target_holds_meets_its_new_children(tmp_path):
    # The source holds "hi" twice (without the unique index), the target once;
    # below the source's first "hi" are new messages, and the twin has them too.
    # The twin is mapped onto the target's "hi" a round after that row's
    # children were found new: its own children must find those, not be new again.
    shared, target, source = tmp_path / "shared.db", tmp_path / "target.db", tmp_path / "source.db"
    _save(shared, [(None, ["hi"])])
    shutil.copyfile(shared, target)
    shutil.copyfile(shared, source)
    _save(source, [(1, ["yes", "no"])])
    _twin(source, 0)
    results = _three_ways(tmp_path, target, source)
    assert results["all"] == results["below new"] == results["none"]
    rows, counts = results["all"]
    assert counts == (2, 3, 1)  # "yes" and "no" added; the twin and its two mapped; "hi" held
    assert [(m[0], m[1]) for m in rows["map"]] == [
        (f"twin-{m}", m) for m in sorted(i for (i, *_) in rows["messages"] if i != "root")
    ]
    assert len(rows["messages"]) == 4  # root, "hi", "yes", "no": nothing twice


# -- llm messages: keyed by their hash, settled in the pass that finds what the target holds


def _llm_rows(path: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(path) as conn:
        return {
            "messages": conn.execute("SELECT hash, parent_hash, role, provider_metadata FROM messages ORDER BY 1").fetchall(),
            "parts": conn.execute("SELECT message_hash, position, type, tool_name, text, payload FROM parts ORDER BY 1, 2").fetchall(),
        }


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), shared=st.sampled_from([0.0, 0.5, 1.0]))
def test_llm_messages_stored_children_first_take_the_rounds_and_end_the_same(seed, shared):
    from fixtures import family_llm

    import dagsync.merge.messages as messages

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        laptop, desk = (r.path for r in family_llm(d / "family", seed=seed, machines=2, conversations=4, shared_fraction=shared))
        reversed_source = d / "reversed.db"
        shutil.copyfile(desk, reversed_source)
        _reverse_llm(reversed_source)
        results, rounds = {}, []
        for name, source in (("in order", desk), ("children first", reversed_source)):
            (d / name).mkdir()
            target = d / name / "t.db"
            shutil.copyfile(laptop, target)
            with pytest.MonkeyPatch.context() as mp:
                real = messages._rounds
                mp.setattr(messages, "_rounds", lambda run, table, total: rounds.append(name) or real(run, table, total))
                merge(target, [source])
            results[name] = _llm_rows(target)
        assert results["in order"] == results["children first"]
        assert "in order" not in rounds
        new_with_new_parent = _new_below_new(laptop, desk)
        assert ("children first" in rounds) == new_with_new_parent


def _reverse_llm(path: Path) -> None:
    """An llm file whose messages are stored children first: every rowid negated."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE messages SET rowid = -rowid")


def _new_below_new(target: Path, source: Path) -> bool:
    """Whether the source has a message the target lacks under another it lacks (then order matters)."""
    with sqlite3.connect(source) as conn:
        conn.execute("ATTACH DATABASE ? AS t", (str(target),))
        return conn.execute(
            "SELECT 1 FROM messages c JOIN messages p ON p.hash = c.parent_hash "
            "WHERE c.hash NOT IN (SELECT hash FROM t.messages) AND p.hash NOT IN (SELECT hash FROM t.messages) LIMIT 1"
        ).fetchone() is not None
