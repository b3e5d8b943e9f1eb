"""llm-format histories for the laws of incremental merges and push/pull:
three llm 0.36 databases that synced once, and ``llm logs rm`` as llm's users
do it by hand. Needs llm installed (the ``test`` extra)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import apsw

from dagsync import bookkeeping
from dagsync.gc import gc
from fixtures import family_llm


@contextlib.contextmanager
def llm_machines(seed: int) -> Iterator[list[Path]]:
    """Three llm databases that synced once and went their own ways, each in a folder of its own."""
    with tempfile.TemporaryDirectory() as d:
        made = family_llm(Path(d) / "family", seed=seed, machines=3, conversations=6, shared_fraction=0.5)
        paths = []
        for name, report in zip(("laptop", "server", "desk"), made):
            (Path(d) / name).mkdir()
            paths.append(Path(d) / name / "logs.db")
            shutil.move(report.path, paths[-1])
        yield paths


def logs_rm(path: Path, row: int) -> None:
    """Delete a thread that nothing forked from, with its turns and what hangs off them (as
    ``llm logs rm`` would), then gc what only it reached.

    The file is stamped as rewritten, as a deletion by dagsync is (gc, and
    issue 6/6's forget): marks made before no longer hold for it as a target.
    A deletion by hand in a target is not seen by an incremental merge
    (docs/consolidation.md); one in a source is, and the law covers it.
    """
    with contextlib.closing(apsw.Connection(str(path))) as conn, conn:
        ids = [
            r for (r,) in conn.execute(
                "SELECT id FROM threads t WHERE NOT EXISTS (SELECT 1 FROM threads f WHERE f.forked_from = t.id) ORDER BY id"
            )
        ]  # fmt: skip
        if len(ids) < 2:
            return
        gone = ids[row % len(ids)]
        turns = "SELECT id FROM turns WHERE thread_id = ?"
        for table in ("turn_search", "turn_fragments", "turn_tools", "tool_instantiations"):
            conn.execute(f"DELETE FROM {table} WHERE turn_id IN ({turns})", (gone,))
        conn.execute("DELETE FROM turns WHERE thread_id = ?", (gone,))
        conn.execute("DELETE FROM threads WHERE id = ?", (gone,))
        bookkeeping.rewritten(conn, "forget")
    gc(path, grace=0)
