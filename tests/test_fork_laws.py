"""Hypothesis: forks do not depend on which file is the target, and sync converges.

Two machines that synced once and then each continued shared conversations
(``fixtures.family``, ``family_llm``): merging B into A and A into B give the
same conversation (thread) rows, forks included, with every call (turn) on
the same row; after ``sync A B`` both files hold the same rows, and a second
sync writes nothing. Each file keeps its own name in every copy, because a
fork's name says which file its branch came from.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dagsync.formats.dag import DAG
from dagsync.formats.llm import LLM
from dagsync.merge import merge
from dagsync.sync import sync
from fixtures import family, family_llm
from tests.history import message_paths

FORMATS = {"dag": (family, DAG), "llm": (family_llm, LLM)}


def pointers_and_calls(path: Path, fmt) -> tuple[list, list]:
    """Every conversation row, its head as the content path it names (a dag
    message merged onto a row of the same content keeps that row's id, which
    differs by target), and which conversation each call is on."""
    table = fmt.table(fmt.conversation_table)
    paths = message_paths(path) if fmt is DAG else {}
    with sqlite3.connect(path) as conn:
        columns = [c[1] for c in conn.execute(f'PRAGMA table_info("{table.name}")')]
        head = columns.index(table.pointer)
        rows = [
            tuple(paths.get(v, v) if i == head else v for i, v in enumerate(row))
            for row in conn.execute(f'SELECT * FROM "{table.name}" ORDER BY 1')
        ]
        calls = conn.execute(f'SELECT id, "{fmt.call_conversation}" FROM "{fmt.call_table}" ORDER BY 1').fetchall()
    return rows, calls


def machines(directory: Path, kind: str, seed: int) -> list[Path]:
    make, _ = FORMATS[kind]
    return [r.path for r in make(directory / "fam", seed=seed, machines=2, conversations=40, shared_fraction=0.5)]


@contextlib.contextmanager
def two_machines(kind: str, seed: int) -> Iterator[tuple[Path, Path, Path]]:
    """A scratch directory (hypothesis runs many examples in one test) and the family's two files."""
    if kind == "llm":
        pytest.importorskip("llm")
    with tempfile.TemporaryDirectory() as d:
        yield Path(d), *machines(Path(d), kind, seed)


def copy_as(path: Path, directory: Path) -> Path:
    """A copy under the same file name (fork names come from it)."""
    directory.mkdir(parents=True)
    shutil.copyfile(path, directory / path.name)
    return directory / path.name


def writes(report) -> int:
    return sum(s.written for m in (report.into_a, report.into_b, report.settle) if m for s in m.sources)


@pytest.mark.parametrize("kind", ["dag", "llm"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000))
def test_either_direction_gives_the_same_conversations_and_calls(kind, seed):
    with two_machines(kind, seed) as (d, a, b):
        ab, ba = copy_as(a, d / "ab"), copy_as(b, d / "ba")
        merge(ab, [b])
        merge(ba, [a])
        fmt = FORMATS[kind][1]
        assert pointers_and_calls(ab, fmt) == pointers_and_calls(ba, fmt)
        assert merge(ab, [b]).sources[0].written == 0
        assert merge(ba, [a]).sources[0].written == 0


@pytest.mark.parametrize("kind", ["dag", "llm"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_sync_converges_and_a_second_sync_writes_nothing(kind, seed):
    with two_machines(kind, seed) as (_, a, b):
        sync(a, b)
        fmt = FORMATS[kind][1]
        assert pointers_and_calls(a, fmt) == pointers_and_calls(b, fmt)
        assert writes(sync(a, b)) == 0


@pytest.mark.parametrize("kind", ["dag", "llm"])
def test_the_laws_are_tried_on_files_that_fork(kind, tmp_path):
    """The families above do diverge: a merge each way forks, once as a swap."""
    if kind == "llm":
        pytest.importorskip("llm")
    a, b = machines(tmp_path, kind, 3)  # a seed whose families fork, in both formats
    ab, ba = copy_as(a, tmp_path / "ab"), copy_as(b, tmp_path / "ba")
    one, other = merge(ab, [b]).sources[0].forks, merge(ba, [a]).sources[0].forks
    assert one and {f.side for f in one} | {f.side for f in other} == {"source", "target"}
    assert sorted((f.fork, f.name, f.head) for f in one) == sorted((f.fork, f.name, f.head) for f in other)


@pytest.mark.parametrize("kind", ["dag", "llm"])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_a_file_made_by_merging_names_its_branches_after_where_they_came_from(kind, seed):
    """A hub created from A, then given B, holds what A given B holds, fork names
    included: the branches it got from A are A's (``merge.origins``)."""
    with two_machines(kind, seed) as (d, a, b):
        direct = copy_as(a, d / "direct")
        hub = d / "hub" / "hub.db"  # a label of its own
        hub.parent.mkdir()
        merge(hub, [a])
        merge(hub, [b])
        merge(direct, [b])
        fmt = FORMATS[kind][1]
        assert pointers_and_calls(hub, fmt) == pointers_and_calls(direct, fmt)
        # And a third file given the hub names them as if given A and B.
        third, via = copy_as(b, d / "third"), copy_as(b, d / "via")
        merge(third, [a])
        merge(via, [hub])
        assert pointers_and_calls(via, fmt) == pointers_and_calls(third, fmt)


@pytest.mark.parametrize("kind", ["dag", "llm"])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_three_files_merged_one_by_one_in_any_order_give_the_same_hub(kind, seed):
    """Three machines that each continued shared conversations, merged into a
    new hub one file at a time: every order gives the same rows."""
    make, fmt = FORMATS[kind]
    if kind == "llm":
        pytest.importorskip("llm")
    with tempfile.TemporaryDirectory() as d:
        files = [r.path for r in make(Path(d) / "fam", seed=seed, machines=3, conversations=30, shared_fraction=0.5)]
        hubs = []
        for order in itertools.permutations(files):
            hub = Path(d) / f"hub{len(hubs)}" / "hub.db"
            hub.parent.mkdir()
            for path in order:
                merge(hub, [path])
            hubs.append(pointers_and_calls(hub, fmt))
        assert all(h == hubs[0] for h in hubs[1:])
