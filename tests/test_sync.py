"""sync: both files end with the union."""

from __future__ import annotations

from dagsync.sync import sync
from fixtures import family
from tests.history import contains, integrity, logical, union_of


def test_both_files_hold_the_union(tmp_path):
    a, b = (r.path for r in family(tmp_path, seed=31, machines=2, conversations=80))
    union = union_of(logical(a), logical(b))
    report = sync(a, b)
    assert report.into_a.sources[0].written > 0
    for path in (a, b):
        assert contains(logical(path), union) == []
        assert integrity(path) == []
    # Both hold the same conversations (fork rows included) and the same heads by
    # content; a diverged conversation keeps each file's own head, by design.
    assert _conversation_ids(a) == _conversation_ids(b)
    assert logical(a)["heads"] == logical(b)["heads"]
    again = sync(a, b)
    assert again.into_a.sources[0].written == again.into_b.sources[0].written == 0
    assert again.settle is None


def _conversation_ids(path):
    import sqlite3

    with sqlite3.connect(path) as conn:
        return {cid for (cid,) in conn.execute("SELECT id FROM conversations")}
