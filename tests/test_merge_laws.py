"""Hypothesis: merging converges, whatever the order and grouping of the merges."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dagsync.merge import merge
from fixtures import family
from tests.history import contains, integrity, logical, union_of


@settings(max_examples=12)
@given(
    seed=st.integers(0, 10_000),
    machines=st.integers(2, 3),
    shared=st.sampled_from([0.0, 0.5]),
    order=st.randoms(),
    split=st.integers(1, 2),
)
def test_any_order_and_grouping_gives_the_same_history(seed, machines, shared, order, split):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        sources = [r.path for r in family(d / "fam", seed=seed, machines=machines, conversations=16, shared_fraction=shared)]
        union = union_of(*map(logical, sources))

        # All at once, in the given order.
        together = d / "together.db"
        merge(together, sources)

        # Shuffled, and grouped: part of them merged into an intermediate file
        # first, which is then merged (as a source) with the rest.
        shuffled = sources[:]
        order.shuffle(shuffled)
        split = min(split, len(shuffled) - 1)
        first = d / "first.db"
        merge(first, shuffled[:split])
        grouped = d / "grouped.db"
        shutil.copyfile(shuffled[-1], grouped)
        merge(grouped, [first, *shuffled[split:-1]])

        for result in (together, grouped):
            assert integrity(result) == []
            assert contains(logical(result), union) == []
        assert logical(together) == logical(grouped)
