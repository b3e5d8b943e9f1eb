"""The blob store: pack and unpack are lossless, merge and gc and verify understand packed files."""

from __future__ import annotations

import itertools
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from dagsync.blobs import PREFIX, pack
from dagsync.unpack import unpack
from dagsync.cli import app
from dagsync.db import open_target
from dagsync.formats.llm import LLM
from dagsync.gc import gc
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.stats import stats
from dagsync.store import MessageStore
from dagsync.verify import verify
from fixtures import family, family_llm
from tests import strategies
from tests.history import logical
from tests.processes import MODES, kill_at

MARKER_LOOKALIKE = PREFIX + "0" * 64  # a payload that merely looks like a reference


def dump(path: Path) -> list[str]:
    """Every row of every table, except dagsync's own bookkeeping (``_dagsync_*``) and the blob store."""
    with sqlite3.connect(path) as conn:
        return [
            line for line in conn.iterdump()
            if not any(t in line for t in ("_dagsync_", "blob_dicts", 'INTO "blobs"', "TABLE blobs"))
        ]  # fmt: skip


# -- lossless, by hypothesis ------------------------------------------------------------

long_text = st.builds(lambda piece, n: piece * n, st.text(min_size=1, max_size=30), st.integers(1, 60))
texts = st.one_of(long_text, st.just(MARKER_LOOKALIKE), st.text(max_size=20))
messages = st.builds(
    Message,
    role=st.sampled_from(["user", "assistant"]),
    parts=st.lists(st.one_of(strategies.parts, st.builds(TextPart, text=texts)), max_size=4),
)


@given(st.lists(st.lists(messages, min_size=1, max_size=4), min_size=1, max_size=4), st.booleans())
def test_dag_pack_then_unpack_is_the_identity(tmp_path_factory, chains, dictionary):
    path = tmp_path_factory.mktemp("p") / "dag.db"
    with MessageStore.open(path) as store:
        heads = [store.save_chain(chain) for chain in chains + chains[:1]]  # a repeat: shared payloads
        loaded = [store.load_chain(h) for h in heads]
    before = dump(path)

    pack(path, threshold=73, dictionary=dictionary)
    with MessageStore.open(path) as store:
        assert [store.load_chain(h) for h in heads] == loaded  # read transparently
    assert verify(path).problems == ()
    packed = path.read_bytes()
    assert pack(path).payload_bytes == 0  # idempotent: nothing left to pack
    assert path.read_bytes() == packed

    unpack(path)
    assert dump(path) == before
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name IN ('blobs', 'blob_dicts')").fetchone() == (0,)


payload_texts = st.one_of(texts, st.builds(lambda t: json.dumps({"text_ref": [{"literal": t}]}), long_text))
contents = st.one_of(st.binary(max_size=300), st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=20), st.integers(1, 50)), st.just(MARKER_LOOKALIKE.encode()))


@given(
    st.lists(st.tuples(st.none() | texts, st.none() | payload_texts), min_size=1, max_size=12),
    st.lists(texts, max_size=4),
    st.lists(st.none() | contents, max_size=4),
)
def test_llm_pack_then_unpack_is_the_identity(tmp_path_factory, parts, fragments, attachments):
    path = tmp_path_factory.mktemp("p") / "logs.db"
    open_target(path, create=LLM).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO messages (hash, parent_hash, role) VALUES ('b2:m', NULL, 'user')")
        for n, (text, payload) in enumerate(parts + parts[:2]):
            conn.execute(
                "INSERT INTO parts (message_hash, position, type, text, payload) VALUES ('b2:m', ?, 'text', ?, ?)",
                (n, text, payload),
            )
        for n, content in enumerate(fragments):
            conn.execute("INSERT INTO fragments (hash, content) VALUES (?, ?)", (f"h{n}", content))
        for n, content in enumerate(attachments):
            conn.execute("INSERT INTO attachments (id, type, content) VALUES (?, 'x', ?)", (f"a{n}", content))
    before = dump(path)
    pack(path, threshold=73)
    packed = dump(path)
    pack(path)
    assert dump(path) == packed
    unpack(path)
    assert dump(path) == before


# -- merging packed and unpacked files --------------------------------------------------


@pytest.mark.parametrize("fmt", ["dag", "llm"])
def test_merging_packed_and_unpacked_files_in_any_combination_gives_the_same_content(tmp_path, fmt):
    machines = [r.path for r in (family if fmt == "dag" else family_llm)(tmp_path / "fam", seed=9, machines=2, conversations=120)]
    results = {}
    for packed_target, packed_source in itertools.product([False, True], repeat=2):
        target, source = tmp_path / f"t{packed_target}{packed_source}.db", tmp_path / f"s{packed_target}{packed_source}.db"
        shutil.copyfile(machines[0], target)
        shutil.copyfile(machines[1], source)
        if packed_target:
            pack(target, dictionary=True)
        if packed_source:
            pack(source)
        merge(target, [source])
        assert verify(target).problems == ()
        with sqlite3.connect(target) as conn:
            inline = conn.execute(
                "SELECT count(*) FROM " + (
                    "message_parts WHERE typeof(content) = 'text' AND length(CAST(content AS BLOB)) >= 256"
                    if fmt == "dag" else "parts WHERE typeof(text) = 'text' AND length(CAST(text AS BLOB)) >= 256"
                )
            ).fetchone()[0]  # fmt: skip
            has_store = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'blobs'").fetchone()[0]
        assert bool(has_store) == packed_target  # a packed target stays packed; an unpacked one is not packed
        if packed_target:
            assert inline == 0  # what arrived was packed too
        assert merge(target, [source]).sources[0].written == 0
        unpack(target)
        with sqlite3.connect(target) as conn:
            results[(packed_target, packed_source)] = (
                logical(target) if fmt == "dag" else (
                    sorted(conn.execute("SELECT message_hash, position, type, text, payload FROM parts")),
                    sorted(conn.execute("SELECT hash, content FROM fragments")),
                    sorted(conn.execute("SELECT id, content FROM attachments")),
                )
            )  # fmt: skip
    assert all(r == results[(False, False)] for r in results.values())


def test_stats_and_verify_read_a_packed_file(tmp_path):
    path = family(tmp_path / "fam", seed=3, machines=1, conversations=60)[0].path
    expected = stats(path)
    pack(path, dictionary=True)
    assert (stats(path).messages, stats(path).conversations) == (expected.messages, expected.conversations)
    assert verify(path).problems == ()


# -- verify: a tamper test per blob check ---------------------------------------------


@pytest.fixture
def packed(tmp_path) -> Path:
    path = family(tmp_path / "fam", seed=4, machines=1, conversations=60)[0].path
    pack(path, dictionary=True)
    return path


def _one_blob(path: Path, where: str = "1") -> str:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT hash FROM blobs WHERE {where} LIMIT 1").fetchone()[0]


def _checks(path: Path) -> set[tuple[str, str]]:
    return {(p.check, p.table) for p in verify(path).problems}


class TestVerifyBlobs:
    def test_a_blob_that_does_not_decompress(self, packed):
        key = _one_blob(packed)
        with sqlite3.connect(packed) as conn:
            conn.execute("UPDATE blobs SET data = x'00112233' WHERE hash = ?", (key,))
        problems = verify(packed).problems
        assert any(p.check == "blobs" and p.key == key and "does not decompress" in p.what for p in problems)

    def test_a_blob_with_the_wrong_size(self, packed):
        key = _one_blob(packed)
        with sqlite3.connect(packed) as conn:
            conn.execute("UPDATE blobs SET size = size + 1 WHERE hash = ?", (key,))
        assert any(p.key == key and "not its size" in p.what for p in verify(packed).problems)

    def test_a_blob_holding_another_payload(self, packed):
        key, other = (_one_blob(packed, "dict IS NULL"), _one_blob(packed, "dict IS NULL ORDER BY hash DESC"))
        with sqlite3.connect(packed) as conn:
            data, size = conn.execute("SELECT data, size FROM blobs WHERE hash = ?", (other,)).fetchone()
            conn.execute("UPDATE blobs SET data = ?, size = ? WHERE hash = ?", (data, size, key))
        problems = verify(packed).problems
        assert any(p.check == "blobs" and p.key == key and "does not hash to its key" in p.what for p in problems)
        assert ("content", "messages") in {(p.check, p.table) for p in problems}  # and the message no longer re-hashes

    def test_a_missing_blob(self, packed):
        key = _one_blob(packed)
        with sqlite3.connect(packed) as conn:
            conn.execute("DELETE FROM blobs WHERE hash = ?", (key,))
        problems = verify(packed).problems
        assert any(p.check == "blobs" and p.table == "message_parts" and f"blob {key}, which is missing" in p.what for p in problems)

    def test_a_tampered_dictionary(self, packed):
        with sqlite3.connect(packed) as conn:
            conn.execute("UPDATE blob_dicts SET data = data || x'00'")
        assert ("blobs", "blob_dicts") in _checks(packed)


# -- gc and the blob store ----------------------------------------------------------------


def test_gc_deletes_blobs_only_deleted_rows_used(tmp_path):
    path = family_llm(tmp_path / "fam", seed=5, machines=1, conversations=120)[0].path
    pack(path, threshold=73)
    with sqlite3.connect(path) as conn:
        gone = "SELECT id FROM turns WHERE thread_id IN (SELECT id FROM threads WHERE rowid % 2 = 0)"
        for table in ("turn_search", "turn_fragments", "turn_tools", "tool_instantiations"):
            conn.execute(f"DELETE FROM {table} WHERE turn_id IN ({gone})")
        conn.execute(f"DELETE FROM turns WHERE id IN ({gone})")
        conn.execute("UPDATE threads SET forked_from = NULL")
        conn.execute("DELETE FROM threads WHERE rowid % 2 = 0")
        blobs_before = conn.execute("SELECT count(*) FROM blobs").fetchone()[0]
    report = gc(path, grace="0s")  # llm's rows carry no time, and no grace keeps nothing: the first run
    assert report.table("blobs").deleted > 0
    assert gc(path, grace="0s").deleted == 0
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM blobs").fetchone()[0] == blobs_before - report.table("blobs").deleted
    assert verify(path).problems == ()
    unpack(path)
    assert verify(path).problems == ()


# -- crash safety -----------------------------------------------------------------------

# Chunks of 50 rows; the child stops at the event the test picks and is
# killed there (tests.processes.STOPPABLE), in each mode of transactions.
RUN = """
import sys
import dagsync.blobs, dagsync.unpack
{"pack": dagsync.blobs.pack, "unpack": dagsync.unpack.unpack}[sys.argv[1]](sys.argv[2], progress=event)
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("command", "events"), [("pack", 3), ("pack", 9), ("unpack", 2), ("unpack", 7)])
def test_a_killed_pack_or_unpack_leaves_a_whole_file_that_a_rerun_completes(tmp_path, command, events, mode):
    path = family(tmp_path / "fam", seed=6, machines=1, conversations=150)[0].path
    original = dump(path)
    if command == "unpack":
        pack(path, threshold=73)
    assert kill_at(RUN, [command, str(path)], events, mode)[0], "the kill came after the end: it proved nothing"
    assert verify(path).problems == ()
    (pack if command == "pack" else unpack)(path)
    assert verify(path).problems == ()
    unpack(path)
    assert dump(path) == original


# -- the command line ---------------------------------------------------------------------

runner = CliRunner()


class TestCli:
    def test_pack_and_unpack_json(self, tmp_path):
        path = family(tmp_path / "fam", seed=7, machines=1, conversations=40)[0].path
        result = runner.invoke(app, ["pack", str(path), "--json"], catch_exceptions=False)
        assert result.exit_code == 0
        report = json.loads(result.stdout)
        assert report["payload_bytes"] > 0 and report["new_blobs"] == report["distinct_payloads"]
        result = runner.invoke(app, ["unpack", str(path), "--json"], catch_exceptions=False)
        assert result.exit_code == 0
        assert json.loads(result.stdout)["payload_bytes"] == report["payload_bytes"]

    def test_text_report(self, tmp_path):
        path = family(tmp_path / "fam", seed=7, machines=1, conversations=40)[0].path
        result = runner.invoke(app, ["pack", str(path), "--dry-run"], catch_exceptions=False)
        assert result.exit_code == 0
        assert result.stdout.startswith(f"{path}: would pack ")
        assert "dedup" in result.stdout and "compression" in result.stdout

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--level", "23"], "invalid zstd level 23: give a level from 1 (fastest) to 22 (smallest)"),
            (["--threshold", "10"], "invalid threshold 10: payloads shorter than a reference (72 bytes) cannot be packed; give 73 or more"),
        ],
    )
    def test_bad_settings_are_one_line_and_exit_1(self, tmp_path, args, message):
        path = family(tmp_path / "fam", seed=7, machines=1, conversations=5)[0].path
        result = runner.invoke(app, ["pack", str(path), *args])
        assert (result.exit_code, result.stderr) == (1, f"Error: {message}\n")


@pytest.mark.parametrize("fmt", ["dag", "llm"])
def test_a_dry_run_pack_reports_what_a_real_pack_does_and_writes_nothing(tmp_path, fmt):
    path = (family if fmt == "dag" else family_llm)(tmp_path / "fam", seed=8, machines=1, conversations=80)[0].path
    before = path.read_bytes()
    dry = pack(path, dry_run=True)
    assert path.read_bytes() == before
    real = pack(path)
    volatile = ("dry_run", "seconds", "file_bytes_after", "vacuum", "grew")  # what only a real run can know
    assert {k: v for k, v in vars(dry).items() if k not in volatile} == {k: v for k, v in vars(real).items() if k not in volatile}
    assert real.new_blobs > 0
    assert unpack(path, dry_run=True).values == unpack(path).values > 0
