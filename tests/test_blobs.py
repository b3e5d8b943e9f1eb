"""The blob store: pack and unpack are lossless, merge and gc and verify understand packed files."""

from __future__ import annotations

import hashlib
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
from dagsync.formats.dag import DAG
from dagsync.formats.llm import LLM
from dagsync.gc import gc
from dagsync.merkle import fragment_hash
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.stats import stats
from dagsync.store import MessageStore
from dagsync.verify import verify
from fixtures import family, family_llm
from tests import strategies
from tests.history import content_dump, logical
from tests.processes import MODES, events_of, kill_at

MARKER_LOOKALIKE = PREFIX + "0" * 64  # a payload that merely looks like a reference


def dump(path: Path) -> list[str]:
    """Every row of every table, except dagsync's own bookkeeping (``_dagsync_*``) and the blob store;
    full-text indexes by what they index (``history.content_dump``)."""
    return content_dump(path, ("_dagsync_", "blob_dicts", 'INTO "blobs"', "TABLE blobs"))


# -- lossless, by hypothesis ------------------------------------------------------------

long_text = st.builds(lambda piece, n: piece * n, st.text(min_size=1, max_size=30), st.integers(1, 60))
texts = st.one_of(long_text, st.just(MARKER_LOOKALIKE), st.text(max_size=20))
messages = st.builds(
    Message,
    role=st.sampled_from(["user", "assistant"]),
    parts=st.lists(st.one_of(strategies.parts, st.builds(TextPart, text=texts)), max_size=4),
)


# Values llm's legacy tables may hold in a payload column: text (long, short,
# empty, one that reads like a reference), NULL, and bytes (the other storage
# class, which pack leaves alone).
column_values = st.one_of(
    st.none(), texts, st.just(""), st.binary(max_size=120).filter(lambda b: not b.startswith(PREFIX.encode()))
)
PROMPT = "a prompt that is also a message's text, so one blob " * 4


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


@given(
    responses=st.lists(st.tuples(*[column_values] * 6), min_size=1, max_size=5),
    turns=st.lists(st.tuples(column_values, column_values, column_values, column_values), max_size=4),
    tools=st.lists(st.tuples(column_values, column_values), max_size=3),
)
def test_llm_pack_then_unpack_is_the_identity_on_the_turns_and_legacy_tables(tmp_path_factory, responses, turns, tools):
    path = tmp_path_factory.mktemp("p") / "logs.db"
    open_target(path, create=LLM).close()
    with sqlite3.connect(path) as conn:
        for n, values in enumerate([*responses, (PROMPT, None, PROMPT, None, None, None)]):
            conn.execute(
                "INSERT INTO responses (id, model, prompt, system, prompt_json, options_json, response, response_json) "
                "VALUES (?, 'echo', ?, ?, ?, ?, ?, ?)",
                (f"r{n}", *values),
            )
        for n, (options, response_json, prompt, response) in enumerate([*turns, (None, None, PROMPT, PROMPT)]):
            conn.execute(
                "INSERT INTO turns (id, model, options_json, response_json) VALUES (?, 'echo', ?, ?)", (f"u{n}", options, response_json)
            )
            conn.execute("INSERT INTO turn_search (turn_id, prompt, response) VALUES (?, ?, ?)", (f"u{n}", prompt, response))
        for n, (arguments, output) in enumerate(tools):
            conn.execute("INSERT INTO tool_calls (response_id, name, arguments, tool_call_id) VALUES ('r0', 't', ?, ?)", (arguments, f"k{n}"))
            conn.execute("INSERT INTO tool_results (response_id, name, output, tool_call_id) VALUES ('r0', 't', ?, ?)", (output, f"k{n}"))
    before = dump(path)
    pack(path, threshold=73)
    with sqlite3.connect(path) as conn:
        # Both full-text indexes covered packed columns: both are gone, to come back with unpack.
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name LIKE '%_fts%'").fetchone() == (0,)
        # The shared prompt is one blob, referred to from all four places it appears.
        digest = hashlib.sha256(PROMPT.encode())
        assert conn.execute("SELECT count(*) FROM blobs WHERE hash = ?", (digest.hexdigest(),)).fetchone() == (1,)
        # In a column of text, a reference is a BLOB: the prefix and the hash's 32 bytes.
        reference = PREFIX.encode() + digest.digest()
        last = len(responses), len(turns)
        assert conn.execute("SELECT prompt, prompt_json FROM responses WHERE id = ?", (f"r{last[0]}",)).fetchone() == (reference,) * 2
        assert conn.execute("SELECT prompt, response FROM turn_search WHERE turn_id = ?", (f"u{last[1]}",)).fetchone() == (reference,) * 2
    packed = dump(path)
    pack(path)
    assert dump(path) == packed
    unpack(path)
    assert dump(path) == before  # the full-text indexes too, by what they index




@given(
    chains=st.lists(st.lists(messages, min_size=1, max_size=3), min_size=1, max_size=3),
    responses=st.lists(st.tuples(*[column_values] * 6), min_size=1, max_size=6),
    calls=st.lists(st.tuples(column_values, column_values), max_size=3),
    tools=st.lists(st.tuples(column_values, column_values), max_size=4),
    parts=st.lists(st.tuples(column_values, column_values), max_size=3),
    fragments=st.lists(texts, max_size=3),
    attachments=st.lists(contents, max_size=3),
    dictionary=st.booleans(),
)
def test_dag_pack_then_unpack_is_the_identity_on_every_payload_column(
    tmp_path_factory, chains, responses, calls, tools, parts, fragments, attachments, dictionary
):
    path = tmp_path_factory.mktemp("p") / "dag.db"
    with MessageStore.open(path) as store:
        heads = [store.save_chain(chain) for chain in [*chains, [Message(role="user", parts=[TextPart(text=PROMPT)])]]]
        loaded = [store.load_chain(h) for h in heads]
    with sqlite3.connect(path) as conn:
        for n, values in enumerate([*responses, (PROMPT, None, PROMPT, None, None, None)]):
            conn.execute(
                "INSERT INTO responses (id, model, prompt, system, prompt_json, options_json, response, response_json) "
                "VALUES (?, 'echo', ?, ?, ?, ?, ?, ?)",
                (f"r{n}", *values),
            )
        for n, (prompt_json, response_json) in enumerate(calls):
            conn.execute(
                "INSERT INTO calls (id, model, started_at, prompt_json, response_json) VALUES (?, 'echo', '2026', ?, ?)",
                (f"c{n}", prompt_json, response_json),
            )
        for n, (arguments, output) in enumerate(tools):
            conn.execute("INSERT INTO tool_calls (response_id, name, arguments, tool_call_id) VALUES ('r0', 't', ?, ?)", (arguments, f"k{n}"))
            conn.execute("INSERT INTO tool_results (response_id, name, output, tool_call_id) VALUES ('r0', 't', ?, ?)", (output, f"k{n}"))
        for n, (content, content_json) in enumerate(parts):
            conn.execute(
                "INSERT INTO parts (response_id, direction, \"order\", content, content_json) VALUES ('r0', 'in', ?, ?, ?)",
                (n, content, content_json),
            )
        for content in dict.fromkeys(fragments):
            conn.execute("INSERT INTO fragments (hash, content) VALUES (?, ?)", (fragment_hash(content), content))
        for content in dict.fromkeys(c for c in attachments if c):
            conn.execute("INSERT INTO attachments (id, type, content) VALUES (?, 'x', ?)", (hashlib.sha256(content).hexdigest(), content))
    before = dump(path)

    pack(path, threshold=73, dictionary=dictionary)
    with sqlite3.connect(path) as conn:
        # Every payload of at least the threshold, in any column, is one blob:
        # identical bytes in two tables or two columns are one.
        inline = set()
        for column in DAG.packed:
            inline |= {
                bytes(v) if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass")
                for (v,) in conn.execute(f'SELECT "{column.column}" FROM "{column.table}"') if v is not None
            }  # fmt: skip
        blobs = {h for (h,) in conn.execute("SELECT hash FROM blobs")}
        referred = set()
        for column in DAG.packed:
            # A BLOB of the prefix and 32 bytes in a column of text; TEXT, the prefix and hex, in one of bytes.
            referred |= {
                bytes(v)[len(PREFIX):].hex() if isinstance(v, bytes) else v[len(PREFIX):]
                for (v,) in conn.execute(f'SELECT "{column.column}" FROM "{column.table}"')
                if v is not None and (bytes(v) if isinstance(v, bytes) else v.encode()).startswith(PREFIX.encode())
                and (len(v) == 40 and isinstance(v, bytes) and column.holds == "text"
                     or len(v) == 72 and isinstance(v, str) and column.holds == "blob")
            }  # fmt: skip
        assert blobs == referred
        # The full-text index over the packed responses is dropped, not left to index references.
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name LIKE 'responses_fts%' OR name LIKE 'responses_a%'").fetchone() == (0,)
    assert not any(v.startswith(PROMPT.encode()) for v in inline)  # the shared prompt is packed everywhere
    with MessageStore.open(path) as store:
        assert [store.load_chain(h) for h in heads] == loaded  # read transparently
    assert verify(path).problems == ()
    packed = path.read_bytes()
    assert pack(path).payload_bytes == 0  # idempotent: nothing left to pack
    assert path.read_bytes() == packed

    unpack(path)
    assert dump(path) == before  # the full-text index too, by what it indexes


# -- merging packed and unpacked files --------------------------------------------------


@pytest.mark.parametrize("fmt", ["dag", "llm"])
def test_merging_packed_and_unpacked_files_in_any_combination_gives_the_same_content(tmp_path, fmt):
    machines = [r.path for r in (family if fmt == "dag" else family_llm)(tmp_path / "fam", seed=9, machines=2, conversations=120)]
    results = {}
    for packed_target, packed_source in itertools.product([False, True], repeat=2):
        # The same names everywhere: a fork row is named after the file its branch came from.
        (tmp_path / f"{packed_target}{packed_source}").mkdir()
        target, source = (tmp_path / f"{packed_target}{packed_source}" / n for n in ("t.db", "s.db"))
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
            for column in (DAG if fmt == "dag" else LLM).packed:
                with sqlite3.connect(target) as conn:
                    assert conn.execute(
                        f'SELECT count(*) FROM "{column.table}" WHERE typeof("{column.column}") = ? '
                        f'AND length(CAST("{column.column}" AS BLOB)) >= 256', (column.holds,)
                    ).fetchone() == (0,), column  # fmt: skip
        assert merge(target, [source]).sources[0].written == 0
        unpack(target)
        with sqlite3.connect(target) as conn:
            # Every row of every table, and what the full-text index holds.
            results[(packed_target, packed_source)] = dump(target), (
                logical(target) if fmt == "dag" else (
                    sorted(conn.execute("SELECT message_hash, position, type, text, payload FROM parts")),
                    sorted(conn.execute("SELECT hash, content FROM fragments")),
                    sorted(conn.execute("SELECT id, content FROM attachments")),
                )
            )  # fmt: skip
    assert all(r == results[(False, False)] for r in results.values())


def test_a_merge_into_a_packed_file_packs_what_it_brings_and_reads_no_further_back(tmp_path):
    first, second = (r.path for r in family(tmp_path / "fam", seed=4, machines=2, conversations=60))
    pack(first)
    long_text = "written by hand below the mark, after the pack " * 10
    with sqlite3.connect(first) as conn:
        through = int(conn.execute("SELECT value FROM _dagsync_meta WHERE key = 'pack_through:responses.response'").fetchone()[0])
        assert through == conn.execute("SELECT max(rowid) FROM responses").fetchone()[0]
        with sqlite3.connect(second) as other:  # one the other file lacks: edited, it is no conflict
            theirs = {i for (i,) in other.execute("SELECT id FROM responses")}
        mine = next(r for r, i in conn.execute("SELECT rowid, id FROM responses ORDER BY rowid") if i not in theirs)
        conn.execute("UPDATE responses SET response = ? WHERE rowid = ?", (long_text, mine))
    merge(first, [second])
    with sqlite3.connect(first) as conn:
        top = conn.execute("SELECT max(rowid) FROM responses").fetchone()[0]
        assert top > through  # the merge brought responses...
        assert conn.execute(
            "SELECT count(*) FROM responses WHERE rowid > ? AND typeof(response) = 'text' AND length(response) >= 256", (through,)
        ).fetchone() == (0,)  # ...and packed them
        assert conn.execute("SELECT response FROM responses WHERE rowid = ?", (mine,)).fetchone() == (long_text,)  # not read
        assert conn.execute("SELECT value FROM _dagsync_meta WHERE key = 'pack_through:responses.response'").fetchone() == (str(top),)
    assert verify(first).problems == ()
    pack(first)  # pack looks at every row again
    with sqlite3.connect(first) as conn:
        assert conn.execute("SELECT typeof(response) FROM responses WHERE rowid = ?", (mine,)).fetchone() == ("blob",)
    unpack(first)
    with sqlite3.connect(first) as conn:
        assert conn.execute("SELECT count(*) FROM _dagsync_meta WHERE key LIKE 'pack_through:%'").fetchone() == (0,)


def test_stats_and_verify_read_a_packed_file(tmp_path):
    path = family(tmp_path / "fam", seed=3, machines=1, conversations=60)[0].path
    expected = stats(path)
    pack(path, dictionary=True)
    assert (stats(path).messages, stats(path).conversations) == (expected.messages, expected.conversations)
    assert verify(path).problems == ()


def _distinct_packable(path: Path, threshold: int) -> tuple[int, int]:
    """Distinct payloads of at least ``threshold`` bytes over every packed column, and their bytes."""
    seen: dict[bytes, int] = {}
    with sqlite3.connect(path) as conn:
        for column in DAG.packed:
            for (v,) in conn.execute(
                f'SELECT CAST("{column.column}" AS BLOB) FROM "{column.table}" WHERE typeof("{column.column}") = ? '
                f'AND length(CAST("{column.column}" AS BLOB)) >= ?', (column.holds, threshold)
            ):  # fmt: skip
                seen[hashlib.sha256(v).digest()] = len(v)
    conn.close()
    return len(seen), sum(seen.values())


def test_the_report_counts_distinct_payloads_on_a_first_pack_and_on_a_later_one(tmp_path):
    path = family(tmp_path / "fam", seed=5, machines=1, conversations=40)[0].path
    expected = _distinct_packable(path, 256)
    with sqlite3.connect(path) as conn:  # two payloads the first pack will store, to come again later
        known = [v for (v,) in conn.execute(
            "SELECT content FROM message_parts WHERE typeof(content) = 'text' AND length(CAST(content AS BLOB)) >= 256 "
            "GROUP BY content LIMIT 2"
        )]  # fmt: skip
        (message,) = conn.execute("SELECT message_id FROM message_parts LIMIT 1").fetchone()
    conn.close()
    report = pack(path, threshold=256)
    assert (report.distinct_payloads, report.distinct_bytes, report.new_blobs) == (*expected, expected[0])
    new = "a payload the store has never seen, " * 20
    with sqlite3.connect(path) as conn:  # the two it has and one it lacks, each twice
        for n, text in enumerate([*known, new] * 2):
            conn.execute(
                'INSERT INTO message_parts (id, message_id, "order", part_type, content) VALUES (?, ?, ?, \'text\', ?)',
                (f"extra-{n}", message, 1000 + n, text),
            )
    conn.close()
    again = pack(path)
    assert (again.distinct_payloads, again.new_blobs) == (3, 1)
    assert again.distinct_bytes == sum(len(t.encode()) for t in [*known, new])


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


def test_gc_keeps_the_dictionaries_blobs_name_by_id_and_deletes_one_none_names(tmp_path):
    path = family(tmp_path / "fam", seed=6, machines=1, conversations=60)[0].path
    plain = tmp_path / "plain.db"
    shutil.copyfile(path, plain)
    pack(path, dictionary=True)
    spare = b"a dictionary no blob was compressed with"
    with sqlite3.connect(path) as conn:
        ((used, current),) = conn.execute(
            "SELECT count(DISTINCT b.dict), (SELECT value FROM _dagsync_meta WHERE key = 'pack_dict') FROM blobs b"
        ).fetchall()
        assert used == 1 and conn.execute("SELECT typeof(dict) FROM blobs WHERE dict IS NOT NULL LIMIT 1").fetchone() == ("integer",)
        conn.execute("INSERT INTO blob_dicts (id, hash, data) VALUES (99, ?, ?)", (hashlib.sha256(spare).hexdigest(), spare))
        # New rows packed without a dictionary from now on: only the blobs that name it keep it.
        conn.execute("UPDATE _dagsync_meta SET value = '' WHERE key = 'pack_dict'")
    conn.close()
    report = gc(path, grace="0s")
    assert report.table("blob_dicts").deleted == 1
    with sqlite3.connect(path) as conn:
        assert [h for (h,) in conn.execute("SELECT hash FROM blob_dicts")] == [current]
    conn.close()
    assert verify(path).problems == ()
    unpack(path)
    assert dump(path) == dump(plain)


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


@pytest.mark.parametrize("mode", MODES)
def test_an_unpack_killed_while_it_makes_the_full_text_index_again_is_finished_by_the_next(tmp_path, mode):
    path = family(tmp_path / "fam", seed=6, machines=1, conversations=150)[0].path
    original = dump(path)
    pack(path, threshold=73)
    probe = tmp_path / "probe.db"
    shutil.copyfile(path, probe)
    events = events_of(RUN, ["unpack", str(probe)], mode)
    indexing = [n for n, line in enumerate(events, 1) if line.startswith("indexing responses")]
    assert len(indexing) >= 3, "the index was made in one step: no kill could land inside"
    assert kill_at(RUN, ["unpack", str(path)], indexing[len(indexing) // 2], mode)[0], "the kill came after the end"
    assert verify(path).problems == ()
    with sqlite3.connect(path) as conn:  # still packed (the index made, in part, or not yet), so the next unpack finishes it
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'blobs'").fetchone() == (1,)
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

    def test_the_reports_say_the_full_text_index_goes_and_comes_back(self, tmp_path):
        path = family(tmp_path / "fam", seed=7, machines=1, conversations=20)[0].path
        result = runner.invoke(app, ["pack", str(path), "--dry-run"], catch_exceptions=False)
        assert "  would drop the full-text index responses_fts (kept, it would index blob references); unpack makes it again\n" in result.stdout
        result = runner.invoke(app, ["pack", str(path)], catch_exceptions=False)
        assert "  dropped the full-text index responses_fts (kept, it would index blob references); unpack makes it again\n" in result.stdout
        result = runner.invoke(app, ["unpack", str(path), "--json"], catch_exceptions=False)
        assert json.loads(result.stdout)["rebuilt_indexes"] == ["responses_fts"]
        pack(path)
        result = runner.invoke(app, ["unpack", str(path)], catch_exceptions=False)
        assert result.stdout.endswith("\n  made the full-text index responses_fts again\n")

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
