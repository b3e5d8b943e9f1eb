"""Guarantee 5: kill -9 at any moment leaves a consistent target; re-running finishes the job."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dagsync.merge import merge
from fixtures import family
from tests.history import integrity, logical
from tests.processes import kill_after

# Tiny transactions, so there are many commit points; a line per progress
# event, so the test can kill it part-way through, wherever it is. Either
# short transactions (as when another process has the target open) or
# steps of one long transaction (nobody else has it), committed very often.
MERGE = """
import contextlib, sys
import dagsync.merge as m
import dagsync.transactions as t
import dagsync.writer as w
w.TARGET_SECONDS = w.ALONE_TARGET_SECONDS = 0.002
w.FIRST_CHUNK = 50
if sys.argv[1] == "short":
    t.long_transactions = lambda conn: contextlib.nullcontext()
else:
    t.LONG_COMMIT_SECONDS = 0.005
m.merge(sys.argv[2], sys.argv[3:], progress=lambda *a: print(*a, flush=True))
"""
MODES = ("short", "long")


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
    """How many progress events an uninterrupted run prints, by mode (chunk sizes adapt to the machine)."""
    counts = {}
    for mode in MODES:
        target = tmp_path_factory.mktemp("count") / "target.db"
        shutil.copyfile(machines[0], target)
        run = subprocess.run(
            [sys.executable, "-c", MERGE, mode, str(target), str(machines[1])], capture_output=True, text=True, check=True
        )
        counts[mode] = len(run.stdout.splitlines())
    return counts


def run_and_kill(target: Path, sources: list[Path], events: int, mode: str = "short") -> bool:
    """Start a merge, kill -9 it after ``events`` progress events; True if it was still running."""
    return kill_after(MERGE, [mode, str(target), *map(str, sources)], events)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_a_killed_merge_leaves_a_consistent_target_that_a_rerun_completes(
    tmp_path, machines, expected, events, seed, mode
):
    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    rng = random.Random(seed)
    killed = 0
    # Kill it a few times at random moments, within a whole run's events (the
    # first kill lands inside a running merge); every state must be consistent.
    for _ in range(3):
        killed += run_and_kill(target, [machines[1]], rng.randint(1, events[mode] - 1), mode)
        assert integrity(target) == []
    assert killed, "no kill interrupted a running merge: the test proved nothing"
    merge(target, [machines[1]])
    assert logical(target) == expected
    assert integrity(target) == []
    assert merge(target, [machines[1]]).sources[0].written == 0


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
