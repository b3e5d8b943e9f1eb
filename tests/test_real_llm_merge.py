"""The llm format, proven by llm itself: machines made with the real llm CLI
(and the offline llm-echo model) are merged, and llm lists, loads, verifies
and searches the result.
"""

from __future__ import annotations

import binascii
import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

llm = pytest.importorskip("llm")
sqlite_utils = pytest.importorskip("sqlite_utils")
from llm.logs import LogStore  # noqa: E402

TOOL_CALL = '{"tool_calls": [{"name": "llm_version"}]}'


def png(r: int, g: int, b: int) -> bytes:
    """A valid 1x1 PNG of one colour (llm checks attachment types by content)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", binascii.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes([0, r, g, b]))) + chunk(b"IEND", b"")


def cli(user_dir: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "llm", *args],
        env={**os.environ, "LLM_USER_PATH": str(user_dir)},
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return done.stdout


def prompt(user_dir: Path, *args: str) -> None:
    cli(user_dir, "-m", "echo", *args)


def log_schema_turn(db_path: Path) -> None:
    """A turn with a schema, through llm's Python API (echo itself has no schemas)."""
    model = llm.get_model("echo")
    model.supports_schema = True
    response = model.prompt(
        '{"prompt": "give json", "raw": "{\\"answer\\": 42}"}',
        schema={"type": "object", "properties": {"answer": {"type": "integer"}}},
    )
    response.text()
    response.log_to_db(sqlite_utils.Database(db_path))


def responses(db: Path) -> dict[str, dict]:
    out = json.loads(cli(db.parent, "logs", "list", "--json", "-n", "0", "-d", str(db)))
    return {r["id"]: r for r in out}


@pytest.fixture(scope="module")
def machines(tmp_path_factory) -> list[Path]:
    """Three machines: a shared history, then each goes its own way."""
    root = tmp_path_factory.mktemp("machines")
    files = root / "files"
    files.mkdir()
    (files / "shared.txt").write_text("The shared fragment: a page about SQLite's write-ahead log.\n")
    (files / "laptop.txt").write_text("A laptop-only fragment mentioning the xylophone.\n")
    (files / "server.txt").write_text("A server-only fragment mentioning the quasar.\n")
    (files / "red.png").write_bytes(png(255, 0, 0))
    (files / "blue.png").write_bytes(png(0, 0, 255))

    shared = root / "shared"
    prompt(shared, "-s", "You are terse.", "hello from the shared history")
    prompt(shared, "-c", "continue the shared thread")
    prompt(shared, "-f", str(files / "shared.txt"), "summarise the shared fragment")
    prompt(shared, "-a", str(files / "red.png"), "describe the red image")
    prompt(shared, "-T", "llm_version", TOOL_CALL)
    prompt(shared, "-o", "thinking", "1", "think about merging")
    log_schema_turn(shared / "logs.db")

    laptop, server, desktop = root / "laptop", root / "server", root / "desktop"
    for machine in (laptop, server, desktop):
        shutil.copytree(shared, machine)
    # Each continues the same thread differently: the tips diverge.
    prompt(laptop, "-c", "the laptop carries on about the alpaca")
    prompt(server, "-c", "the server carries on about the zeppelin")
    # Independently, the same opening: the same message hashes on both.
    prompt(laptop, "-s", "You are terse.", "hello from the shared history")
    prompt(server, "-s", "You are terse.", "hello from the shared history")
    # New fragments: the same integer id on both machines, different text.
    prompt(laptop, "-f", str(files / "laptop.txt"), "what does the laptop fragment say")
    prompt(server, "-f", str(files / "server.txt"), "what does the server fragment say")
    prompt(laptop, "-a", str(files / "blue.png"), "describe the blue image")
    prompt(server, "-T", "llm_version", TOOL_CALL)
    prompt(server, "-o", "thinking", "1", "the server thinks about the quasar")
    prompt(desktop, "a desktop question about the marmoset")
    return [m / "logs.db" for m in (laptop, server, desktop)]


@pytest.fixture(scope="module")
def merged(tmp_path_factory, machines) -> Path:
    target = tmp_path_factory.mktemp("merged") / "logs.db"
    subprocess.run([sys.executable, "-m", "dagsync", "merge", str(target), *map(str, machines)], check=True)
    return target


def test_the_machines_really_collide_on_fragment_ids(machines):
    def fragment(db: Path, word: str) -> int:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT id FROM fragments WHERE content LIKE ?", (f"%{word}%",)).fetchone()[0]

    assert fragment(machines[0], "xylophone") == fragment(machines[1], "quasar")


def test_llm_lists_every_response_of_every_source(machines, merged):
    union: dict[str, dict] = {}
    for machine in machines:
        union |= responses(machine)
    listed = responses(merged)
    assert set(listed) == set(union)
    for rid, row in union.items():
        assert (listed[rid]["prompt"], listed[rid]["response"]) == (row["prompt"], row["response"])


def test_llm_verifies_every_message(merged):
    assert LogStore(sqlite_utils.Database(merged)).verify() == []


def test_every_thread_of_every_source_loads_the_same(machines, merged):
    store = LogStore(sqlite_utils.Database(merged))
    # Every message on some thread of the target: its tips and all they lead back to.
    on_a_thread = {
        row["hash"]
        for row in store.db.query(
            "WITH RECURSIVE up(hash) AS (SELECT tip_message_hash FROM threads "
            "UNION SELECT m.parent_hash FROM messages m JOIN up ON m.hash = up.hash) SELECT hash FROM up"
        )
    }
    for machine in machines:
        source = LogStore(sqlite_utils.Database(machine))
        for thread in source.db.query("SELECT id, tip_message_hash FROM threads"):
            tip = thread["tip_message_hash"]
            # Kept as a tip, as a fork row's tip (diverged), or fast-forwarded past.
            assert tip in on_a_thread or tip is None
            assert store.load_chain(tip) == source.load_chain(tip)
    for row in store.db.query("SELECT tip_message_hash FROM threads"):
        store.load_chain(row["tip_message_hash"])


def test_no_foreign_key_is_broken(merged):
    with sqlite3.connect(merged) as conn:
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize("word", ["xylophone", "quasar", "marmoset", "alpaca", "zeppelin"])
def test_llm_search_finds_words_only_one_source_had(merged, word):
    found = json.loads(cli(merged.parent, "logs", "-q", word, "--json", "-d", str(merged)))
    assert found and any(word in (r["prompt"] or "") + (r["response"] or "") for r in found)


def test_remapped_fragments_resolve_to_their_own_text(machines, merged):
    store = LogStore(sqlite_utils.Database(merged))
    with sqlite3.connect(merged) as conn:
        contents = {c for (c,) in conn.execute("SELECT content FROM fragments")}
        borrowed = conn.execute(
            "SELECT p.message_hash, f.content FROM part_fragments pf JOIN parts p ON p.id = pf.part_id "
            "JOIN fragments f ON f.id = pf.fragment_id"
        ).fetchall()
    assert any("xylophone" in c for c in contents) and any("quasar" in c for c in contents)
    for message_hash, content in borrowed:
        text = "".join(getattr(p, "text", "") for m in store.load_chain(message_hash)[-1:] for p in m.parts)
        assert content in text


def test_a_diverged_thread_gains_a_fork(merged):
    with sqlite3.connect(merged) as conn:
        forks = conn.execute(
            "SELECT name, forked_from FROM threads WHERE name LIKE '% (branch from %)'"
        ).fetchall()
    assert forks and all(forked_from for _, forked_from in forks)


def test_the_merge_report_and_stats_name_every_fork(tmp_path, machines):
    # The server's prompts came last: its branches keep the threads, the laptop's go to forks.
    target = tmp_path / "laptop" / "logs.db"
    target.parent.mkdir()
    shutil.copyfile(machines[0], target)
    done = subprocess.run(
        [sys.executable, "-m", "dagsync", "merge", str(target), str(machines[1]), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (source,) = json.loads(done.stdout)["sources"]
    assert source["label"] == "server" and source["forks"]
    with sqlite3.connect(target) as conn:
        for fork in source["forks"]:
            assert (fork["table"], fork["side"]) == ("threads", "target")
            assert fork["name"].endswith(" (branch from laptop)")
            row = conn.execute("SELECT name, forked_from, tip_message_hash FROM threads WHERE id = ?", (fork["fork"],)).fetchone()
            assert row == (fork["name"], fork["original"], fork["head"])
    stats = json.loads(subprocess.run(
        [sys.executable, "-m", "dagsync", "stats", str(target), "--json"], capture_output=True, text=True, check=True,
    ).stdout)  # fmt: skip
    listed = {f["id"]: f for f in stats["fork_rows"]}
    for fork in source["forks"]:
        assert (listed[fork["fork"]]["name"], listed[fork["fork"]]["forked_from"]) == (fork["name"], fork["original"])
    # The other way round, the laptop's branches are the source's, named by --label.
    other = tmp_path / "server.db"
    shutil.copyfile(machines[1], other)
    text = subprocess.run(
        [sys.executable, "-m", "dagsync", "merge", str(other), str(machines[0]), "--label", "the big box"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    fork = source["forks"][0]
    assert any(
        line == f"    fork {fork['fork']} of {fork['original']}: '{fork['name'].replace('laptop', 'the big box')}', "
        f"holding the source's branch (tip {fork['head'][:12]})"
        for line in text.splitlines()
    ), text


def test_merging_again_writes_nothing(machines, merged):
    before = merged.read_bytes()
    out = subprocess.run(
        [sys.executable, "-m", "dagsync", "merge", str(merged), *map(str, machines), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    report = json.loads(out)
    assert all(
        t["added"] == t["updated"] == t["forked"] == 0 for s in report["sources"] for t in s["tables"]
    )
    assert merged.read_bytes() == before


def test_a_source_from_a_newer_llm_is_refused(tmp_path, machines):
    newer = tmp_path / "newer.db"
    shutil.copyfile(machines[2], newer)
    with sqlite3.connect(newer) as conn:
        conn.execute("INSERT INTO _llm_migrations VALUES ('m028_from_the_future', '2027-01-01')")
    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    before = target.read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "dagsync", "merge", str(target), str(newer)], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"Error: {newer} was written by a newer llm than {target}: it has migration(s) "
        f"m028_from_the_future that {target} lacks; open {target} once with that newer llm "
        f"(for example `llm logs -n 1 -d {target}`), which migrates it, then merge again\n"
    )
    assert target.read_bytes() == before


def test_a_target_ahead_of_the_source_merges(tmp_path, machines):
    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    with sqlite3.connect(target) as conn:
        conn.execute("INSERT INTO _llm_migrations VALUES ('m028_from_the_future', '2027-01-01')")
    subprocess.run([sys.executable, "-m", "dagsync", "merge", str(target), str(machines[1])], check=True)
    assert LogStore(sqlite_utils.Database(target)).verify() == []


def test_the_llm_plugin_runs_dagsync(machines):
    out = cli(machines[2].parent, "dagsync", "stats", "--json")
    assert json.loads(out)["path"] == str(machines[2])
    assert json.loads(out)["format"] == "llm"


def test_llm_continues_the_newest_conversation_after_a_merge(tmp_path, merged):
    # llm -c picks the thread with the highest id; a fork row (no turns of its
    # own) must not be it, or llm says "No conversation found".
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    shutil.copyfile(merged, user_dir / "logs.db")
    with sqlite3.connect(user_dir / "logs.db") as conn:
        newest = conn.execute("SELECT id FROM threads WHERE forked_from IS NULL ORDER BY id DESC LIMIT 1").fetchone()[0]
        forks = conn.execute("SELECT id, forked_from FROM threads WHERE forked_from IS NOT NULL").fetchall()
    assert forks and all(fork < original for fork, original in forks)  # each sorts just before its original
    prompt(user_dir, "-c", "carrying on after the merge")
    with sqlite3.connect(user_dir / "logs.db") as conn:
        thread = conn.execute("SELECT thread_id FROM turns ORDER BY id DESC LIMIT 1").fetchone()[0]
    assert thread == newest
