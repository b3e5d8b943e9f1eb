"""Bugs a review of gc, the blob store and their merges found, each with the test that
failed before its fix (reproductions by a review helper, /tmp/review/ at the time)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dagsync.blobs import pack
from dagsync.db import open_target
from dagsync.errors import DagsyncError, DamagedSource, UnsupportedDatabase
from dagsync.gc import _Gc, gc
from dagsync.merge import merge
from dagsync.unpack import unpack
from dagsync.verify import verify
from tests.test_gc import DAY, NOW, OLD, dag_db, keys, llm_db, llm_keys


def rows(path: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(sql).fetchall()


def test_gc_reads_references_inside_a_packed_payload(tmp_path):
    path = llm_db(tmp_path / "l.db", [("b2:keep", None)], tips={"t": "b2:keep"}, turns=[])
    payload = json.dumps({"text_ref": [{"literal": "x" * 300}, {"fragment": 5}], "attachment": {"id": "att-1"}})
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO fragments (id, hash, content) VALUES (5, 'h5', 'fragment five')")
        conn.execute("INSERT INTO attachments (id, content) VALUES ('att-1', x'0102')")
        conn.execute("UPDATE parts SET text = NULL, payload = ?", (payload,))
    pack(path)
    assert rows(path, "SELECT typeof(payload) FROM parts") == [("blob",)]
    gc(path, now=NOW)
    gc(path, now=NOW + 15 * DAY)
    assert keys(path, "SELECT id FROM fragments") == {5}
    assert keys(path, "SELECT id FROM attachments") == {"att-1"}


def _gc_in_another_process(path: Path, now: float) -> dict:
    code = (
        "import json, sys; from dagsync.gc import gc; "
        f"r = gc({str(path)!r}, grace='1d', now={now!r}); "
        "print(json.dumps({'merging': r.merge_in_progress, 'deleted': r.deleted}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_gc_waits_for_a_merge_from_its_plan_on(tmp_path):
    # The plan maps the source's m1, m2 onto the target's (unreachable, old)
    # m1, m2; a gc between plan and copy must not delete them.
    old = OLD["old-iso"]
    target = dag_db(tmp_path / "t.db", [("m1", "root", old), ("m2", "m1", old)], heads={}, calls=[])
    source = dag_db(tmp_path / "s.db", [("m1", "root", old), ("m2", "m1", old), ("m3", "m2", old)], {"c": "m3"}, [])
    seen = []

    def progress(phase: str, done: int, total: int) -> None:
        if phase == "planned" and not seen:
            seen.append(_gc_in_another_process(target, NOW))

    merge(target, [source], progress=progress)
    assert seen == [{"merging": True, "deleted": 0}]
    assert verify(target).problems == ()
    assert keys(target, "SELECT id FROM messages") == {"root", "m1", "m2", "m3"}


def test_gc_keeps_shared_rows_while_a_merge_copies(tmp_path):
    prompt = "the system prompt"
    digest = hashlib.sha256(prompt.encode()).hexdigest()
    target = llm_db(tmp_path / "t.db", [("b2:t", None)], tips={"t": "b2:t"}, turns=[], proven=True)
    with sqlite3.connect(target) as conn:  # unreferenced, its grace clock started long ago
        conn.execute("INSERT INTO fragments (id, hash, content) VALUES (5, ?, ?)", (digest, prompt))
    gc(target, now=NOW)
    source = llm_db(tmp_path / "s.db", [("b2:s", None)], tips={"s": "b2:s"}, turns=[], proven=True)
    with sqlite3.connect(source) as conn:  # the source uses the same fragment (matched by hash)
        conn.execute("INSERT INTO fragments (id, hash, content) VALUES (1, ?, ?)", (digest, prompt))
        conn.execute("INSERT INTO part_fragments SELECT id, 1, 0 FROM parts")
    seen = []

    def progress(phase: str, done: int, total: int) -> None:
        if phase.startswith("copying") and not seen:
            seen.append(_gc_in_another_process(target, NOW + 15 * DAY))

    merge(target, [source], progress=progress)
    assert seen and seen[0]["merging"]
    assert keys(target, "SELECT id FROM fragments") == {5}
    assert rows(target, "PRAGMA foreign_key_check") == []


def test_what_a_kept_back_message_borrows_inside_json_is_kept_too(tmp_path):
    path = llm_db(tmp_path / "l.db", [("b2:keep", None), ("b2:m", None)], tips={"t": "b2:keep"}, turns=[])
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO fragments (id, hash, content) VALUES (5, 'h5', 'fragment five')")
        conn.execute(
            "UPDATE parts SET text = NULL, payload = ? WHERE message_hash = 'b2:m'",
            (json.dumps({"text_ref": [{"literal": "x"}, {"fragment": 5}]}),),
        )
    gc(path, grace="1h", now=NOW)
    db = open_target(path)
    run = _Gc(db, 3600.0, NOW + 7200, False, None)
    run.mark()
    with sqlite3.connect(path) as conn:  # llm continues from b2:m meanwhile
        conn.execute("INSERT INTO messages (hash, parent_hash, role) VALUES ('b2:child', 'b2:m', 'user')")
        conn.execute("INSERT INTO threads (id, name, tip_message_hash) VALUES ('t2', 't', 'b2:child')")
    run.sweep()
    run.sweep_shared()
    run.drop_temp()
    db.close()
    assert run.kept_as_new == 1
    assert keys(path, "SELECT id FROM fragments") == {5}


def test_gc_keeps_what_the_files_own_foreign_keys_point_at(tmp_path):
    nodes = [("b2:keep", None), ("b2:pinned", None)]
    path = llm_db(tmp_path / "l.db", nodes, tips={"t": "b2:keep"}, turns=[])
    with sqlite3.connect(path) as conn:  # a plugin's tables, declared with foreign keys
        conn.execute("CREATE TABLE bookmarks (id INTEGER PRIMARY KEY, message_hash TEXT REFERENCES messages(hash))")
        conn.execute("INSERT INTO bookmarks (message_hash) VALUES ('b2:pinned')")
        conn.execute("INSERT INTO fragments (id, hash, content) VALUES (7, 'h7', 'pinned text')")
        conn.execute("CREATE TABLE pins (id INTEGER PRIMARY KEY, fragment_id INTEGER REFERENCES fragments(id))")
        conn.execute("INSERT INTO pins (fragment_id) VALUES (7)")
    gc(path, grace="0s", now=NOW)
    gc(path, grace="0s", now=NOW + 1)
    assert keys(path, "SELECT hash FROM messages") == {"b2:keep", "b2:pinned"}
    assert keys(path, "SELECT id FROM fragments") == {7}
    assert rows(path, "PRAGMA foreign_key_check") == []


def test_gc_refuses_a_file_a_newer_llm_migrated(tmp_path):
    path = llm_db(tmp_path / "l.db", [("b2:a", None)], tips={}, turns=[])
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO _llm_migrations (name) VALUES ('m028_message_bookmarks')")
    before = path.read_bytes()
    with pytest.raises(UnsupportedDatabase) as info:
        gc(path, grace="0s", now=NOW)
    assert str(info.value) == (
        f"{path} was written by a newer llm than this dagsync knows (migration(s) m028_message_bookmarks); "
        "gc cannot tell what its new tables point at, so it deletes nothing: update dagsync"
    )
    assert path.read_bytes() == before


def test_a_packed_sources_dangling_json_reference_stops_the_merge_before_any_write(tmp_path):
    source = llm_db(tmp_path / "s.db", [("b2:a", None)], tips={"s": "b2:a"}, turns=[])
    with sqlite3.connect(source) as conn:
        conn.execute(
            "UPDATE parts SET text = NULL, payload = ?",
            (json.dumps({"text_ref": [{"literal": "y" * 300}, {"fragment": 99}]}),),
        )
    pack(source)
    target = llm_db(tmp_path / "t.db", [("b2:x", None)], tips={"x": "b2:x"}, turns=[])
    before = target.read_bytes()
    with pytest.raises(DamagedSource, match="refers to fragments 99"):
        merge(target, [source])
    assert target.read_bytes() == before


def test_payloads_that_are_not_utf8_survive_pack_and_unpack_and_a_merge_names_them(tmp_path):
    """Bytes that are not UTF-8 in a TEXT column come back exactly from pack and
    unpack. A merge cannot prove such a message (neither llm nor its hash can
    read the text): it names the message and writes nothing."""
    nodes = [("b2:a", None), ("b2:b", "b2:a")]
    key = llm_keys(nodes)
    source = llm_db(tmp_path / "s.db", nodes, tips={"s": "b2:b"}, turns=[], proven=True)
    with sqlite3.connect(source) as conn:
        conn.execute("UPDATE parts SET text = CAST(x'6361666580' AS TEXT) WHERE message_hash = ?", (key["b2:b"],))  # short
        conn.execute("UPDATE parts SET text = CAST(? AS TEXT) WHERE message_hash = ?", (b"long \xff " * 100, key["b2:a"]))
    expected = rows(source, "SELECT message_hash, hex(text), typeof(text) FROM parts ORDER BY 1")
    packed = tmp_path / "p.db"
    shutil.copyfile(source, packed)
    assert pack(packed).payload_bytes > 0
    target = llm_db(tmp_path / "t.db", [("b2:x", None)], tips={"x": "b2:x"}, turns=[], proven=True)
    before = target.read_bytes()
    with pytest.raises(DamagedSource) as info:
        merge(target, [packed])
    assert str(info.value) == (
        f"{packed}: message {key['b2:a']} does not match its key: its parts cannot be read back: 'utf-8' codec "
        "can't decode byte 0xff in position 5: invalid start byte; it was not copied, and nothing was merged - "
        f"run `dagsync verify {packed}` to see every damaged row, and restore the source from a backup"
    )
    assert target.read_bytes() == before
    unpack(packed)
    assert rows(packed, "SELECT message_hash, hex(text), typeof(text) FROM parts ORDER BY 1") == expected


def test_the_same_divergence_merged_from_differently_named_files_does_not_conflict(tmp_path):
    thread = "01jh0000000000000000000000"  # a ULID, as llm writes
    a = llm_db(tmp_path / "a.db", [("b2:m1", None), ("b2:m2", "b2:m1")], tips={thread: "b2:m2"}, turns=[], proven=True)
    c = llm_db(tmp_path / "c.db", [("b2:m1", None), ("b2:m3", "b2:m1")], tips={thread: "b2:m3"}, turns=[], proven=True)
    x, y, c2 = tmp_path / "x.db", tmp_path / "y.db", tmp_path / "c-copy.db"
    for copy, original in ((x, a), (y, a), (c2, c)):
        shutil.copyfile(original, copy)
    merge(x, [c])
    merge(y, [c2])
    merge(x, [y])  # once: MergeConflict on the fork thread's name
    # One branch, one fork, whichever file it came through; the target's name stays.
    ((name,),) = rows(x, "SELECT name FROM threads WHERE forked_from IS NOT NULL")
    assert name.startswith("t (branch from ")


LOOKALIKES = {
    # A 40-byte BLOB in a column of text (the short form); 72 characters of TEXT in a column of bytes.
    "short-blob-in-text": (
        "UPDATE parts SET text = ?", (b"dagsync:" + bytes(32),), "parts.text of rowid 1 is a BLOB"
    ),
    "text-in-bytes": (
        "INSERT INTO attachments (id, content) VALUES ('a', ?)", ("dagsync:" + "ab" * 32,),
        "attachments.content of rowid 1 is TEXT",
    ),
}


@pytest.mark.parametrize("case", list(LOOKALIKES))
def test_pack_refuses_a_value_that_reads_like_a_reference(tmp_path, case):
    sql, params, what = LOOKALIKES[case]
    path = llm_db(tmp_path / "l.db", [("b2:a", None)], tips={"t": "b2:a"}, turns=[])
    with sqlite3.connect(path) as conn:
        conn.execute(sql, params)
    before = path.read_bytes()
    with pytest.raises(DagsyncError) as info:
        pack(path)
    assert str(info.value) == (
        f"{what} that reads like a blob reference ('dagsync:' and a hash); "
        "a packed file would take it for one, so pack refuses: change or remove that value first"
    )
    assert path.read_bytes() == before
    assert verify(path).counts.get("blobs", 0) == 0  # unpacked: a look-alike is just a value
