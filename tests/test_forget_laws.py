"""forget's laws, over arbitrary histories (hypothesis).

1. forget then gc deletes exactly the messages reachable only from the
   forgotten conversations (computed here, independently, from the chains
   the test itself saved), and forget alone already did: gc finds nothing
   more.
2. forget is idempotent: a second run deletes nothing and changes nothing.
3. Across three machines, no order of prompts, forks, forgets, merges, syncs,
   pushes and pulls (over a real sshd) brings a forgotten conversation back;
   once every pair is synced, every machine holds exactly the conversations
   that were never forgotten, and nothing unreachable.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dagsync.forget import Selector, forget, forgotten
from dagsync.formats.dag import ROOT
from dagsync.gc import gc
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.remote import Remote, Transport, pull, push
from dagsync.store import MessageStore
from dagsync.sync import sync
from dagsync.verify import verify
from tests.sshd import server  # noqa: F401  (the fixture)
from tests.history import content_dump
from tests.test_fork_histories import machines, prompt

# -- 1 and 2: one file ---------------------------------------------------------

# A conversation: where it starts (None: a new root; k: the k-th message saved
# so far, a fork), the words of its messages (few, so that chains saved apart
# meet as one row), and which of its messages its calls end at.
conversation = st.tuples(
    st.none() | st.integers(0, 40),
    st.lists(st.sampled_from("abc"), min_size=1, max_size=4),
    st.lists(st.integers(0, 3), max_size=2),
)
histories = st.lists(conversation, min_size=1, max_size=8).flatmap(
    lambda convs: st.tuples(st.just(convs), st.sets(st.integers(0, len(convs) - 1), min_size=1))
)


def build(path: Path, convs: list[tuple]) -> tuple[list[str], dict[str, str | None], dict[str, set[str]]]:
    """Save the conversations; return (conversation ids, message -> parent, conversation -> messages it points at)."""
    saved: list[str] = []
    parents: dict[str, str | None] = {}
    ids: list[str] = []
    points: dict[str, set[str]] = {}
    with MessageStore.open(path) as store:
        for start, words, calls in convs:
            parent = saved[start % len(saved)] if start is not None and saved else ROOT
            chain = []
            for word in words:
                parent = store.save_chain([Message(role="user", parts=[TextPart(text=word)])], starting_parent_id=parent)
                chain.append(parent)
                if parent not in parents:
                    parents[parent] = next(
                        p for (p,) in store.conn.execute("SELECT parent_id FROM messages WHERE id = ?", (parent,))
                    )
                    saved.append(parent)
            conv = store.start_conversation("c", "echo", chain[-1])
            ids.append(conv)
            points[conv] = {chain[-1]}
            for k in calls:
                out = chain[k % len(chain)]
                store.record_call(model="echo", head_input_message_id=None, head_output_message_id=out, conversation_id=conv)
                points[conv].add(out)
    return ids, parents, points


def reach(heads: set[str], parents: dict[str, str | None]) -> set[str]:
    out: set[str] = set()
    for head in heads:
        while head is not None and head != ROOT and head not in out:
            out.add(head)
            head = parents[head]
    return out


def message_ids(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {m for (m,) in conn.execute("SELECT id FROM messages WHERE id != ?", (ROOT,))}


@given(history=histories)
def test_forget_then_gc_deletes_exactly_what_only_the_forgotten_conversations_reached(tmp_path_factory, history):
    convs, chosen = history
    path = tmp_path_factory.mktemp("law") / "dag.db"
    ids, parents, points = build(path, convs)
    gone = {ids[k] for k in chosen}
    kept = set(ids) - gone
    only_forgotten = reach(set().union(*(points[c] for c in gone)), parents) - reach(
        set().union(set(), *(points[c] for c in kept)), parents
    )
    before = message_ids(path)

    report = forget(path, Selector(ids=tuple(sorted(gone))))
    assert before - message_ids(path) == only_forgotten
    assert report.messages == len(only_forgotten)
    assert gc(path, grace="0s").deleted == 0  # forget left nothing for gc
    assert message_ids(path) == before - only_forgotten
    with sqlite3.connect(path) as conn:
        assert {c for (c,) in conn.execute("SELECT id FROM conversations")} == kept
        assert not conn.execute("SELECT 1 FROM message_parts WHERE message_id NOT IN (SELECT id FROM messages)").fetchall()
        assert {c for (c,) in conn.execute("SELECT conversation_id FROM calls")} <= kept
    assert verify(path).problems == ()
    with MessageStore.open(path) as store:
        for conv in kept:
            assert len(store.load_chain(store.conversation_head(conv))) >= 1

    # Idempotent: the same forget again deletes nothing and leaves the same rows.
    dump = content_dump(path)
    again = forget(path, Selector(ids=tuple(sorted(gone))))
    assert (again.deleted, again.messages) == (0, 0)
    assert content_dump(path) == dump


# -- 3: three machines -----------------------------------------------------------


pair = st.permutations(range(3)).map(lambda p: (p[0], p[1]))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("prompt"), st.integers(0, 2), st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("fork"), st.integers(0, 2), st.integers(0, 5)),
        st.tuples(st.just("forget"), st.integers(0, 2), st.integers(0, 5)),
        pair.map(lambda p: ("merge", *p)),
        pair.map(lambda p: ("sync", *p)),
        pair.map(lambda p: ("push", *p)),
        pair.map(lambda p: ("pull", *p)),
    ),
    min_size=3,
    max_size=12,
)


def conversations(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {c for (c,) in conn.execute("SELECT id FROM conversations")}


def merge_forks(paths: list[Path], of: set[str]) -> set[str]:
    """The fork rows merges made of the conversations ``of`` (and of those forks), as any file records them."""
    records: set[tuple[str, str]] = set()
    for path in paths:
        with sqlite3.connect(path) as conn:
            if conn.execute("SELECT 1 FROM sqlite_schema WHERE name = '_dagsync_forks'").fetchall():
                records |= set(conn.execute("SELECT key, fork_key FROM _dagsync_forks WHERE key != fork_key"))
    family, grown = set(of), True
    while grown:
        more = {fork for key, fork in records if key in family} - family
        family |= more
        grown = bool(more)
    return family - of


def kept_forgotten(path: Path) -> set[str]:
    return {key for key, _ in forgotten(path)}


@settings(max_examples=int(os.environ.get("DAGSYNC_PUSH_EXAMPLES", 6)), deadline=None)
@given(history=steps, seed=st.integers(0, 2**16))
@example(
    history=[("forget", 0, 0), ("prompt", 1, 0, 1), ("merge", 0, 1), ("push", 1, 2), ("fork", 2, 1),
             ("pull", 2, 0), ("sync", 1, 2), ("forget", 2, 1)],
    seed=5,
)  # fmt: skip
# Two machines continue a conversation differently and a third forgets it; one
# of the first two merges the other's branch (a fork row) before the forget
# reaches it: the fork goes with the conversation.
@example(
    history=[("prompt", 0, 0, 1), ("prompt", 1, 0, 2), ("forget", 2, 0), ("merge", 0, 1), ("sync", 2, 0)],
    seed=1,
)  # fmt: skip
def test_no_order_of_merges_syncs_pushes_and_pulls_brings_a_forgotten_conversation_back(server, history, seed):
    transport = Transport(server.rsh, server.remote_dagsync)
    with machines(seed) as (files, clock):
        seen = set().union(*(conversations(f) for f in files))  # every conversation any file held
        gone: set[str] = set()  # every conversation forgotten, on any machine
        for step in history:
            kind = step[0]
            if kind == "prompt":
                if conversations(files[step[1]]):
                    prompt(files[step[1]], clock, step[2], f"w{step[3]}")
            elif kind == "fork":
                with MessageStore.open(files[step[1]], new_id=clock.ids(), now=clock.iso) as store:
                    heads = [h for (h,) in store.conn.execute("SELECT head_message_id FROM conversations ORDER BY id")]
                    if heads:
                        store.fork(heads[step[2] % len(heads)], "a fork", "echo")
            elif kind == "forget":
                held = sorted(conversations(files[step[1]]))
                if held:
                    chosen = held[step[2] % len(held)]
                    report = forget(files[step[1]], Selector(ids=(chosen,)))
                    assert chosen in {c.id for c in report.conversations}
                    gone.add(chosen)
            elif kind == "merge":
                merge(files[step[1]], [files[step[2]]])
            elif kind == "sync":
                sync(files[step[1]], files[step[2]])
            elif kind == "push":
                push(files[step[1]], Remote(server.host, str(files[step[2]])), transport)
            else:
                pull(Remote(server.host, str(files[step[1]])), files[step[2]], transport)
            for path in files:
                # What a file keeps forgotten it never holds, nor a merge's fork of it, whatever reached it.
                dead = kept_forgotten(path)
                assert dead <= gone, step
                assert not conversations(path) & (dead | merge_forks([path], dead)), step
                seen |= conversations(path)

        # Sync every pair: one history, with every forget in it.
        for a, b in ((0, 1), (1, 2), (0, 1)):
            sync(files[a], files[b])
        dead = gone | merge_forks(files, gone)
        expected = conversations(files[0])  # with the forks these syncs made
        assert seen - dead <= expected  # nothing lost but what was forgotten
        for path in files:
            assert conversations(path) == expected, path.name
            assert not expected & dead, path.name  # nothing forgotten back
            assert kept_forgotten(path) == gone
            assert verify(path).problems == ()
            assert gc(path, grace="0s", dry_run=True).unreachable == 0  # nothing left behind
        copy = files[0].with_name("copy.db")
        shutil.copyfile(files[0], copy)
        merge(copy, [files[1], files[2]], full=True)  # a full merge of every holder brings nothing back either
        assert conversations(copy) == expected
