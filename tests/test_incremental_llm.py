"""The law of incremental merges (tests/test_incremental.py) for the llm format.

Three llm 0.36 databases that synced once (``fixtures.family_llm``) go on as
llm would: threads continued (their tips move), new threads, forks
(``LogStore.fork``), a thread deleted as ``llm logs rm`` deletes one and
then gc, a thread forgotten (``dagsync forget``), a VACUUM, a file replaced by another machine's. Between those
steps they are merged, synced and bundled into each other. Every merge is
made twice from the same target, once from its marks and once ``full``, and
the two targets hold the same rows, table by table: the incremental merge
ends where a full one does, whatever made it fall back.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import sqlite3

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from dagsync.blobs import pack
from dagsync.merge import merge
from dagsync.sync import sync
from dagsync.unpack import unpack
from dagsync.verify import verify
from fixtures.llm_format import grow_llm
from tests.llm_history import llm_machines, logs_rm
from tests.test_incremental import bundled_both_ways, dagsync_forget, merged_both_ways

pytest.importorskip("llm")

def two(kind: str) -> st.SearchStrategy[tuple[str, int, int]]:
    """A step between two different machines."""
    return st.permutations(range(3)).map(lambda p: (kind, p[0], p[1]))


steps = st.lists(
    st.one_of(
        # machine, threads continued, new threads, forks
        st.tuples(st.just("grow"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 1), st.integers(0, 1)),
        two("merge"), two("sync"), two("bundle"), two("replace"),
        st.tuples(st.just("rm"), st.integers(0, 2), st.integers(0, 7)),
        st.tuples(st.just("vacuum"), st.integers(0, 2)),
        st.tuples(st.just("forget"), st.integers(0, 2), st.integers(0, 7)),
    ),
    min_size=3,
    max_size=14,
)


@settings(max_examples=int(os.environ.get("DAGSYNC_EXAMPLES", 12)), deadline=None)
@given(history=steps, seed=st.integers(0, 2**16))
@example(
    history=[("grow", 0, 1, 1, 1), ("merge", 1, 0), ("grow", 0, 2, 0, 0), ("merge", 1, 0), ("rm", 0, 3),
             ("merge", 1, 0), ("vacuum", 0), ("grow", 0, 1, 1, 0), ("bundle", 1, 0), ("replace", 0, 2),
             ("grow", 0, 1, 0, 1), ("merge", 1, 0), ("sync", 1, 2)],
    seed=1,
)  # fmt: skip
# Forgotten on the target, then continued and forked from on the source: read whole.
@example(
    history=[("merge", 1, 0), ("forget", 1, 0), ("forget", 1, 1), ("grow", 0, 2, 1, 1), ("merge", 1, 0),
             ("forget", 0, 2), ("grow", 2, 2, 0, 1), ("bundle", 0, 2), ("sync", 0, 1)],
    seed=3,
)  # fmt: skip
def test_an_llm_merge_from_the_marks_ends_as_a_full_merge_does(history, seed):
    days = itertools.count(400)
    with llm_machines(seed) as files:
        for step in history:
            if step[0] == "grow":
                _, machine, continued, new, forks = step
                day = next(days)
                grow_llm(files[machine], seed=seed, stream=day, continued=continued, new=new, forks=forks, day=day)
            elif step[0] == "merge":
                report, _ = merged_both_ways(files[step[1]], files[step[2]])
                event(f"merge read the source {'from its marks' if report.incremental else 'whole: ' + report.full_because.split(' (')[0]}")
            elif step[0] == "bundle":
                bundled_both_ways(files[step[1]], files[step[2]])
            elif step[0] == "rm":
                logs_rm(files[step[1]], step[2])
            elif step[0] == "forget":
                dagsync_forget(files[step[1]], step[2], "threads")
            elif step[0] == "vacuum":
                with contextlib.closing(sqlite3.connect(files[step[1]])) as conn:
                    conn.execute("VACUUM")
            elif step[0] == "replace":
                shutil.copyfile(files[step[2]], files[step[1]])
            else:
                a, b = files[step[1]], files[step[2]]
                merged_both_ways(a, b)
                merged_both_ways(b, a)
                sync(a, b)
        for path in files:
            assert verify(path).problems == ()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("logs rm, then gc", "the source's "),
        ("vacuum", "the source's "),
        ("replaced", "the source's "),
        ("gc of the target", "the target was changed since (gc at "),
        ("unpack of the target", "the target was changed since (unpack at "),
    ],
)
def test_each_way_marks_stop_holding_makes_an_llm_merge_read_the_source_whole(change, why):
    with llm_machines(seed=5) as (laptop, server, desk):
        grow_llm(laptop, seed=5, stream=1, continued=2, new=1, day=400)
        merge(server, [laptop])
        if change == "logs rm, then gc":
            logs_rm(laptop, -1)  # the newest thread: the rows at the marks (a deletion below them changes nothing)
            grow_llm(laptop, seed=5, stream=2, continued=1, new=1, day=401)
        elif change == "vacuum":
            logs_rm(laptop, -1)
            grow_llm(laptop, seed=5, stream=2, continued=1, new=1, day=401)  # takes the freed rowids
            with contextlib.closing(sqlite3.connect(laptop)) as conn:
                conn.execute("VACUUM")
        elif change == "replaced":
            grow_llm(desk, seed=5, stream=3, continued=1, new=2, day=401)
            shutil.copyfile(desk, laptop)
        elif change == "gc of the target":
            logs_rm(server, 2)
        else:
            pack(server)
            unpack(server)
        grow_llm(laptop, seed=5, stream=4, continued=1, new=1, day=402)
        report, _ = merged_both_ways(server, laptop)
        assert not report.incremental
        assert report.full_because.startswith(why), report.full_because
        grow_llm(laptop, seed=5, stream=5, continued=1, new=1, day=403)
        again, _ = merged_both_ways(server, laptop)
        assert again.incremental
