"""Incremental merges (merge.marks, merge.delta): a source merged before is read
only beyond its marks, and the target ends exactly as a full merge leaves it.

* The law (hypothesis): any history of prompts (on a conversation or a
  fork), merges, syncs, bundles, deletions, vacuums, replaced files and
  ``dagsync forget`` between three dag-format machines; every merge is
  made twice from the same target, once from the marks and once ``full``,
  and the two targets hold the same rows, table by table.
* Each way the marks stop holding makes the merge read the source whole and
  say why: a source vacuumed after a delete, rows deleted by gc or by hand,
  a file replaced by another at the same path; a target changed by gc,
  canonicalise or unpack. The result is the full merge's.
* What marks are kept, and what an incremental merge reads and writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import time
from pathlib import Path

import apsw
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dagsync import bookkeeping, bundle
from dagsync.blobs import pack
from dagsync.canonicalise import canonicalise
from dagsync.db import open_unchecked_source
from dagsync.errors import DagsyncError
from dagsync.forget import Selector
from dagsync.forget import forget as forget_conversations
from dagsync.formats import Key
from dagsync.gc import gc
from dagsync.merge import merge
from dagsync.merge import marks
from dagsync.merge.core import source_label
from dagsync.remote import Retry
from dagsync.sync import sync
from dagsync.unpack import unpack
from dagsync.verify import verify
from tests.test_fork_histories import THREE_MACHINES, machines, prompt

# dagsync's records of its own marks: what differs between an incremental and a full merge.
MARK_TABLES = {"_dagsync_sources", "_dagsync_marks", "_dagsync_mark_pointers", "_dagsync_mark_digests", "_dagsync_mark_files"}


def rows(path: Path) -> dict[str, list[tuple]]:
    """Every row of every table but the marks', sorted: what two targets must agree on."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        # An FTS index's segments (its _data and _idx tables) are laid out by the
        # order rows came and went, not by what they index: a full merge inserts
        # a forgotten thread's search rows and then deletes them again.
        virtual = [v for (v,) in conn.execute("SELECT name FROM sqlite_schema WHERE sql LIKE 'CREATE VIRTUAL%'")]
        segments = {f"{v}_{part}" for v in virtual for part in ("data", "idx")}
        names = [
            n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table' AND sql NOT LIKE 'CREATE VIRTUAL%'")
            if not n.startswith("sqlite_") and n not in MARK_TABLES and n not in segments
        ]
        found = {}
        for name in names:
            found[name] = sorted(conn.execute(f'SELECT * FROM "{name}"').fetchall(), key=repr)
        return found


def by_content(path: Path) -> dict[str, list[tuple]]:
    """``rows`` without integer ids: every table's rows with its integer key, the
    columns referring to integer-keyed rows, and ids inside JSON left out.

    What two targets must agree on when one of them copied rows of a forgotten
    conversation and deleted them again (a full merge's reapply): an integer id
    means nothing outside its file, and those it took are not given again.
    """
    with open_unchecked_source(path) as db:
        fmt = db.format
    found = {}
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        for name in rows(path):
            if name.startswith("_dagsync_") or not any(t.name == name for t in fmt.tables):
                continue  # dagsync's records and derived tables (FTS) hold rowids throughout
            table = fmt.table(name)
            integer = {c for c, ref in fmt.references[name].items() if fmt.table(ref).key is Key.INTEGER}
            integer |= {"id"} if table.key is Key.INTEGER else set()
            integer |= {j.column for j in table.json_refs}
            kept = [r[1] for r in conn.execute(f'PRAGMA table_info("{name}")') if r[1] not in integer]
            columns = ", ".join(f'"{c}"' for c in kept)
            found[name] = sorted(conn.execute(f'SELECT {columns} FROM "{name}"').fetchall(), key=repr)
    return found


def merged_both_ways(target: Path, source: Path, **kwargs) -> tuple:
    """Merge ``source`` into ``target`` from its marks, and into a copy of the
    target as it was, in full; both reports, after checking the targets agree
    (row for row; by content where the full merge copied forgotten rows and
    deleted them again, taking integer ids the other did not)."""
    full = target.with_name(target.stem + "-full.db")
    shutil.copyfile(target, full)
    report = merge(target, [source], **kwargs)
    full_report = merge(full, [source], full=True, target_label=source_label(target), **kwargs)
    if full_report.sources[0].forgotten or report.sources[0].forgotten:
        assert by_content(target) == by_content(full)
    else:
        assert rows(target) == rows(full)
    full.unlink()
    return report.sources[0], full_report.sources[0]


# Besides prompts, merges and syncs: a bundle of one machine made against
# another's marks and merged there; a conversation deleted by hand (as `llm
# logs rm` does) and then gc; a VACUUM; a file replaced by another machine's.
more_steps = st.lists(
    st.one_of(
        st.tuples(st.just("prompt"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("merge"), st.integers(0, 2), st.integers(0, 2)).filter(lambda s: s[1] != s[2]),
        st.tuples(st.just("sync"), st.integers(0, 2), st.integers(0, 2)).filter(lambda s: s[1] != s[2]),
        st.tuples(st.just("bundle"), st.integers(0, 2), st.integers(0, 2)).filter(lambda s: s[1] != s[2]),
        st.tuples(st.just("rm"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("vacuum"), st.integers(0, 2)),
        st.tuples(st.just("replace"), st.integers(0, 2), st.integers(0, 2)).filter(lambda s: s[1] != s[2]),
        st.tuples(st.just("forget"), st.integers(0, 2), st.integers(0, 3)),
    ),
    min_size=3,
    max_size=16,
)


def forget(path: Path, row: int) -> None:
    """Delete a conversation and its calls, then gc what only it reached.

    The file is stamped as rewritten, as a deletion by dagsync is (gc, and
    issue 6/6's forget): marks made before no longer hold for it as a target.
    A deletion by hand in a target is not seen by an incremental merge
    (docs/consolidation.md); one in a source is, and the law covers it:
    the stamp says nothing about the file as a source.
    """
    conn = apsw.Connection(str(path))
    try:
        with conn:
            ids = [r for (r,) in conn.execute("SELECT id FROM conversations ORDER BY id")]
            if len(ids) < 2:
                return  # one is kept, for prompts to go on
            gone = ids[row % len(ids)]
            conn.execute("DELETE FROM calls WHERE conversation_id = ?", (gone,))
            conn.execute("DELETE FROM conversations WHERE id = ?", (gone,))
            bookkeeping.rewritten(conn, "forget")
    finally:
        conn.close()
    gc(path, grace=0)


def dagsync_forget(path: Path, row: int, table: str = "conversations") -> None:
    """``dagsync forget`` of one conversation (tombstoned; the marks still hold)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        ids = [r for (r,) in conn.execute(f'SELECT id FROM "{table}" ORDER BY id')]
    if len(ids) >= 2:  # one is kept, for prompts to go on
        forget_conversations(path, Selector(ids=(ids[row % len(ids)],)))


def bundled_both_ways(target: Path, source: Path) -> None:
    """A bundle of ``source`` made against ``target``'s marks, merged into it; and a full merge
    into a copy of the target as it was: the two agree."""
    full = target.with_name(target.stem + "-full.db")
    shutil.copyfile(target, full)
    out = target.with_name("bundle.db")
    out.unlink(missing_ok=True)
    # Refused for what it left out (a pointer row its source moved in place, a
    # row a forget removed from the target): made again as push makes it.
    retry = Retry()
    while True:
        out.unlink(missing_ok=True)
        bundle.make(source, retry.marks(bundle.marks_of(target)), out, all_pointers=retry.all_pointers)
        try:
            report = merge(target, [out])
            break
        except DagsyncError as exc:
            if not retry.after(exc):
                raise
    full_report = merge(full, [source], full=True, target_label=source_label(target))
    if full_report.sources[0].forgotten or report.sources[0].forgotten:
        assert by_content(target) == by_content(full)
    else:
        assert rows(target) == rows(full)
    full.unlink()
    out.unlink()


@settings(max_examples=int(os.environ.get("DAGSYNC_EXAMPLES", 20)), deadline=None)
@given(history=more_steps, seed=st.integers(0, 2**32))
@example(history=THREE_MACHINES, seed=0)
@example(history=[("prompt", 0, 0, 1), ("merge", 1, 0), ("rm", 0, 1), ("prompt", 0, 1, 2), ("merge", 1, 0),
                  ("vacuum", 0), ("prompt", 0, 0, 3), ("bundle", 1, 0), ("merge", 2, 1), ("rm", 2, 0),
                  ("merge", 2, 0)], seed=1)  # fmt: skip
# A forget in a target, then the source continues the forgotten conversation:
# merged from the marks, the new message's parent is gone; read whole instead.
# Bundled, the same: made again whole.
@example(history=[("merge", 1, 0), ("forget", 1, 0), ("prompt", 0, 0, 2), ("merge", 1, 0), ("forget", 2, 1),
                  ("merge", 2, 0), ("forget", 0, 1), ("prompt", 1, 1, 3), ("bundle", 0, 1), ("sync", 0, 2)],
         seed=0)  # fmt: skip
def test_a_merge_from_the_marks_ends_as_a_full_merge_does(history, seed):
    with machines(seed) as (files, clock):
        for step in history:
            if step[0] == "prompt":
                _, machine, row, words = step
                prompt(files[machine], clock, row, f"w{words}")
            elif step[0] == "merge":
                merged_both_ways(files[step[1]], files[step[2]])
            elif step[0] == "bundle":
                bundled_both_ways(files[step[1]], files[step[2]])
            elif step[0] == "rm":
                forget(files[step[1]], step[2])
            elif step[0] == "forget":
                dagsync_forget(files[step[1]], step[2])
            elif step[0] == "vacuum":
                with sqlite3.connect(files[step[1]]) as conn:
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


def test_a_second_merge_reads_from_the_marks_and_a_third_with_nothing_new_writes_nothing():
    with machines() as (files, clock):
        laptop, server, _ = files
        first, _ = merged_both_ways(server, laptop)
        assert (first.incremental, first.full_because) == (False, "first merge of this source")
        prompt(laptop, clock, 0, "more")
        second, _ = merged_both_ways(server, laptop)
        assert second.incremental and second.full_because is None
        assert second.table("calls").added == 1 and second.table("messages").added == 2
        before = server.read_bytes()
        third = merge(server, [laptop]).sources[0]
        assert third.incremental and third.written == 0
        assert server.read_bytes() == before


def _delete_last_call(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM calls WHERE rowid = (SELECT max(rowid) FROM calls)")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("delete", "the source's calls row"),
        ("vacuum", "the source's calls row"),
        ("replace", "first merge of this source"),
    ],
)
def test_a_source_changed_below_its_marks_is_read_whole_and_the_report_says_why(change, why):
    with machines() as (files, clock):
        laptop, server, desk = files
        prompt(laptop, clock, 0, "one")
        merge(server, [laptop])
        if change == "delete":
            _delete_last_call(laptop)  # llm logs rm, or by hand: the row at the mark is gone
        elif change == "vacuum":
            _delete_last_call(laptop)
            prompt(laptop, clock, 1, "two")  # takes the freed rowid
            with sqlite3.connect(laptop) as conn:
                conn.execute("VACUUM")
        else:
            prompt(desk, clock, 1, "elsewhere")
            shutil.copyfile(desk, laptop)  # another file at the same path (the same first migration)
            desk_conn = apsw.Connection(str(laptop))
            desk_conn.execute("UPDATE _llm_migrations SET applied_at = '2030-01-01 00:00:00.000'")
            desk_conn.close()
        prompt(laptop, clock, 0, "after")
        report, _ = merged_both_ways(server, laptop)
        assert not report.incremental
        assert report.full_because.startswith(why), report.full_because


def test_a_target_gc_since_the_marks_makes_the_next_merge_read_the_source_whole():
    with machines() as (files, clock):
        laptop, server, _ = files
        prompt(laptop, clock, 0, "one")
        merge(server, [laptop])
        # An unreachable message in the target, for gc to delete.
        with sqlite3.connect(server) as conn:
            conn.execute(
                "INSERT INTO messages (id, parent_id, content_hash, role, created_at) "
                "VALUES ('01aaaaaaaaaaaaaaaaaaaaaaaa', 'root', 'x', 'user', '2000-01-01T00:00:00Z')"
            )
        assert gc(server, grace=0).deleted
        report, _ = merged_both_ways(server, laptop)
        assert not report.incremental
        assert report.full_because.startswith("the target was changed since (gc at "), report.full_because
        after = merge(server, [laptop]).sources[0]
        assert after.incremental


def test_a_copy_that_went_on_elsewhere_keeps_marks_of_its_own():
    """Two files of one identity (logs.db copied to a new laptop): each path has its own marks."""
    with machines() as (files, clock):
        laptop, server, desk = files  # copies of one file: one identity
        for _ in range(2):
            prompt(laptop, clock, 0, "l")
            prompt(desk, clock, 1, "d")
            merged_both_ways(server, laptop)
            merged_both_ways(server, desk)
        assert merge(server, [laptop]).sources[0].incremental
        assert merge(server, [desk]).sources[0].incremental
        with sqlite3.connect(server) as conn:
            assert conn.execute("SELECT count(DISTINCT identity), count(*) FROM _dagsync_sources").fetchone() == (1, 2)


def test_a_moved_source_is_still_read_from_its_marks():
    with machines() as (files, clock):
        laptop, server, _ = files
        merge(server, [laptop])
        moved = laptop.with_name("renamed.db")
        laptop.rename(moved)
        prompt(moved, clock, 0, "after the move")
        report, _ = merged_both_ways(server, moved)
        assert report.incremental


def _head_back(path: Path) -> None:
    """Move the first conversation's head back one message, in place: no row added."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(
            "UPDATE conversations SET head_message_id = (SELECT parent_id FROM messages WHERE id = head_message_id) "
            "WHERE rowid = (SELECT min(rowid) FROM conversations)"
        )


def _recorded_heads(target: Path) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(target)) as conn:
        return conn.execute("SELECT key, head FROM _dagsync_mark_pointers ORDER BY key").fetchall()


def _source_heads(source: Path) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(source)) as conn:
        return conn.execute("SELECT id, head_message_id FROM conversations ORDER BY id").fetchall()


def _reads_a_delta(target: Path, source: Path) -> bool:
    """Whether merging ``source`` into ``target`` extracts what lies beyond its marks."""
    seen: list[str] = []
    hook = lambda conn: conn.trace_v2(apsw.SQLITE_TRACE_STMT, lambda event: seen.append(event["sql"]))  # noqa: E731
    apsw.connection_hooks.append(hook)
    try:
        report = merge(target, [source]).sources[0]
    finally:
        apsw.connection_hooks.remove(hook)
    assert report.incremental and report.full_because is None
    return any('temp."dl_' in sql for sql in seen)


def test_a_source_nothing_was_written_to_since_its_marks_is_not_read_at_all():
    """Its file's state (SQLite's change counter, inode, size, time) is as the
    marks found it: nothing to read, not even its pointer rows."""
    with machines() as (files, clock):
        laptop, server, _ = files
        prompt(laptop, clock, 0, "one")
        merge(server, [laptop])
        assert marks.file_state(laptop) is not None
        before = server.read_bytes()
        assert not _reads_a_delta(server, laptop)
        assert server.read_bytes() == before
        # A pointer moved in place adds no row, but writes the file: it is read and merged.
        _head_back(laptop)
        assert _reads_a_delta(server, laptop)
        assert _recorded_heads(server) == _source_heads(laptop)
        assert not _reads_a_delta(server, laptop)


def test_a_file_put_in_a_source_place_with_the_same_counter_is_read():
    """Two copies of one file, each with one pointer moved in place: the same
    rows, the same change counter. The one merged, then the other copied over
    it: its time tells it apart, and its pointer rows are read."""
    with machines() as (files, clock):
        laptop, server, _ = files
        prompt(laptop, clock, 0, "one")
        prompt(laptop, clock, 1, "two")
        twin = laptop.with_name("twin.db")
        shutil.copyfile(laptop, twin)
        _head_back(laptop)
        with contextlib.closing(sqlite3.connect(twin)) as conn, conn:
            conn.execute(
                "UPDATE conversations SET head_message_id = (SELECT parent_id FROM messages WHERE id = head_message_id) "
                "WHERE rowid = (SELECT max(rowid) FROM conversations)"
            )
        assert marks.file_state(laptop).split(":")[0] == marks.file_state(twin).split(":")[0]
        merge(server, [laptop])
        time.sleep(0.05)  # past the file system's clock tick
        shutil.copyfile(twin, laptop)
        assert _reads_a_delta(server, laptop)
        assert _recorded_heads(server) == _source_heads(laptop)


def test_a_source_in_wal_mode_has_its_pointer_rows_read_every_time():
    """Commits to a WAL leave the header's counter alone: no state is kept."""
    with machines() as (files, clock):
        laptop, server, _ = files
        with contextlib.closing(sqlite3.connect(laptop)) as conn:
            assert conn.execute("PRAGMA journal_mode = WAL").fetchone() == ("wal",)
        prompt(laptop, clock, 0, "one")
        merge(server, [laptop])
        assert marks.file_state(laptop) is None
        with contextlib.closing(sqlite3.connect(server)) as conn:
            assert conn.execute("SELECT count(*) FROM _dagsync_mark_files").fetchone() == (0,)
        assert _reads_a_delta(server, laptop)
        _head_back(laptop)
        assert _reads_a_delta(server, laptop)
        assert _recorded_heads(server) == _source_heads(laptop)


def test_a_file_state_changes_with_every_commit_and_is_none_where_it_cannot_be_trusted(tmp_path):
    path = tmp_path / "x.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
        first = marks.file_state(path)
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
        second = marks.file_state(path)
    assert first is not None and second is not None
    assert int(second.split(":")[0]) == int(first.split(":")[0]) + 1
    assert marks.file_state(tmp_path / "missing.db") is None
    wal = tmp_path / "x.db-wal"
    wal.write_bytes(b"")
    assert marks.file_state(path) is None  # a WAL beside it may hold commits the header does not count
    wal.unlink()
    data = bytearray(path.read_bytes())
    data[92:96] = (int.from_bytes(data[92:96], "big") - 1).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    assert marks.file_state(path) is None  # the counter is not the one SQLite last wrote


def _twin(path: Path) -> None:
    """A second copy of one message under the same parent (as files from before the
    unique index hold), for canonicalise to collapse."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("DROP INDEX idx_messages_parent_hash_unique")
        (first,) = conn.execute("SELECT id FROM messages WHERE id != 'root' ORDER BY id LIMIT 1").fetchone()
        twin = "7ZZZZZZZZZZZZZZZZZZZZZZZZZ"
        conn.execute(
            "INSERT INTO messages SELECT ?, parent_id, content_hash, role, provider_metadata_json, created_at "
            "FROM messages WHERE id = ?", (twin, first),
        )  # fmt: skip
        conn.execute(
            'INSERT INTO message_parts SELECT id || \'-twin\', ?, "order", part_type, content, content_json, tool_call_id, '
            "server_executed FROM message_parts WHERE message_id = ?", (twin, first),
        )  # fmt: skip


@pytest.mark.parametrize("change", ["canonicalise", "unpack"])
def test_a_target_canonicalised_or_unpacked_since_the_marks_makes_the_next_merge_read_the_source_whole(change):
    with machines() as (files, clock):
        laptop, server, _ = files
        prompt(laptop, clock, 0, "one")
        merge(server, [laptop])
        if change == "canonicalise":
            _twin(server)
            assert canonicalise(server).collapsed == 1
        else:
            pack(server)
            unpack(server)
        prompt(laptop, clock, 1, "two")
        report, _ = merged_both_ways(server, laptop)
        assert not report.incremental
        assert report.full_because.startswith(f"the target was changed since ({change} at "), report.full_because
        assert merge(server, [laptop]).sources[0].incremental


def test_a_target_restored_from_a_backup_merges_from_the_marks_it_holds():
    """A restored file holds the marks of when it was saved: the merge reads from
    those, and brings back everything the backup missed."""
    with machines() as (files, clock):
        laptop, server, _ = files
        prompt(laptop, clock, 0, "one")
        merge(server, [laptop])
        backup = server.with_name("backup.db")
        shutil.copyfile(server, backup)
        prompt(laptop, clock, 0, "two")
        merge(server, [laptop])
        shutil.copyfile(backup, server)
        prompt(laptop, clock, 1, "three")
        report, _ = merged_both_ways(server, laptop)
        assert report.incremental
        assert report.table("calls").added == 2


@pytest.mark.parametrize("digests", ["kept", "from before they were kept"])
def test_a_bundle_leaving_out_a_pointer_its_source_moved_in_place_is_refused_whole(digests):
    """The source moved a conversation's head back to an older message: nothing beyond
    the marks says so, but the digest of its pointer rows does."""
    with machines() as (files, clock):
        laptop, server, _ = files
        prompt(laptop, clock, 0, "one")
        prompt(laptop, clock, 1, "two")
        merge(server, [laptop])
        if digests != "kept":
            with contextlib.closing(sqlite3.connect(server)) as conn, conn:
                conn.execute("DROP TABLE _dagsync_mark_digests")  # as a target merged by dagsync before it
        with contextlib.closing(sqlite3.connect(laptop)) as conn, conn:
            conn.execute(
                "UPDATE conversations SET head_message_id = (SELECT parent_id FROM messages WHERE id = head_message_id) "
                "WHERE id = (SELECT min(id) FROM conversations)"
            )
        prompt(laptop, clock, 1, "three")
        out = server.with_name("bundle.db")
        bundle.make(laptop, bundle.marks_of(server), out)
        before = server.read_bytes()
        with pytest.raises(DagsyncError) as refused:
            merge(server, [out])
        assert str(refused.value) == (
            f"{out} leaves out conversations rows its source changed in place (the digest of its pointers does not "
            "match); nothing was merged - make the bundle again with --all-pointers"
        )
        assert server.read_bytes() == before
        out.unlink()
        bundled_both_ways(server, laptop)  # with every pointer row: taken, and as a full merge leaves it
        prompt(laptop, clock, 0, "four")
        bundle.make(laptop, bundle.marks_of(server), out)
        assert merge(server, [out]).sources[0].table("calls").added == 1  # the digest kept up to date
