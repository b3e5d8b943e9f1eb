"""Guarantee 5: kill -9 at any moment leaves a consistent target; re-running finishes the job."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from dagsync.merge import merge
from fixtures import family
from tests.history import integrity, logical
from tests.processes import MODES, events_of, kill_at

# Chunks of 50 rows, so there are many commit points; the child stops at the
# event the test picks and is killed there (tests.processes.STOPPABLE): in
# planning, inside a write step, or between two. In each mode: short
# transactions (as when another process has the target open), steps of a
# long transaction committed at each step's end, or one long transaction.
MERGE = """
import sys
import dagsync.merge as m
m.merge(sys.argv[1], sys.argv[2:], progress=event)
"""
@pytest.fixture(scope="module")
def machines(tmp_path_factory) -> list[Path]:
    return [r.path for r in family(tmp_path_factory.mktemp("crash"), seed=51, machines=2, conversations=700)]


@pytest.fixture(scope="module")
def expected(tmp_path_factory, machines) -> dict:
    target = tmp_path_factory.mktemp("whole") / "merged.db"
    shutil.copyfile(machines[0], target)
    merge(target, [machines[1]])
    return logical(target)


@pytest.fixture(scope="module")
def events(tmp_path_factory, machines) -> dict[str, int]:
    """How many events an uninterrupted run has, by mode (the same every time:
    chunks are fixed, and every progress report is an event)."""
    counts = {}
    for mode in MODES:
        target = tmp_path_factory.mktemp("count") / "target.db"
        shutil.copyfile(machines[0], target)
        counts[mode] = len(events_of(MERGE, [str(target), str(machines[1])], mode))
    return counts


def run_and_kill(target: Path, sources: list[Path], event: int, mode: str = "short") -> bool:
    """Start a merge, kill -9 it at its ``event``-th event; True if it was still running."""
    return kill_at(MERGE, [str(target), *map(str, sources)], event, mode)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(3))
def test_a_killed_merge_leaves_a_consistent_target_that_a_rerun_completes(
    tmp_path, machines, expected, events, seed, mode
):
    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    rng = random.Random(seed)
    killed = 0
    # Kill it a few times at random events of a whole run (the first kill
    # lands in a running merge: the child stops there); every state must be
    # consistent. Later runs have less to do, and may end before their event.
    for _ in range(3):
        killed += run_and_kill(target, [machines[1]], rng.randint(1, events[mode] - 1), mode)
        assert integrity(target) == []
    assert killed, "no kill interrupted a running merge: the test proved nothing"
    merge(target, [machines[1]])
    assert logical(target) == expected
    assert integrity(target) == []
    assert merge(target, [machines[1]]).sources[0].written == 0


# Holds the message proofs back (they gate every commit) for SLOW_PROOFS seconds.
SLOW_PROOFS = """
import os as _os2, time as _time2
import dagsync.merge.proofs as _proofs
_prove = _proofs.MessageProofs._prove
def _slow_prove(self, conn):
    _time2.sleep(float(_os2.environ["SLOW_PROOFS"]))
    return _prove(self, conn)
_proofs.MessageProofs._prove = _slow_prove
"""


def test_a_runs_events_do_not_depend_on_when_its_commits_may_happen(tmp_path, machines, events, monkeypatch):
    # On a loaded machine the proofs end late, and a long transaction's steps
    # go on uncommitted meanwhile: the kill points must be the same events.
    monkeypatch.setenv("SLOW_PROOFS", "2")
    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    assert len(events_of(SLOW_PROOFS + MERGE, [str(target), str(machines[1])], "long")) == events["long"]


def test_a_kill_while_creating_a_new_target(tmp_path, machines):
    target = tmp_path / "new.db"
    for events in (1, 5, 40):
        run_and_kill(target, machines, events)
        if target.exists() and target.stat().st_size:
            assert integrity(target) == []
    merge(target, machines)
    whole = tmp_path / "whole.db"
    merge(whole, machines)
    assert logical(target) == logical(whole)
