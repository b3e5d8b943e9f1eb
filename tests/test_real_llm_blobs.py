"""The blob store with the real client: llm's own databases, packed, merged and
unpacked, read by llm as if nothing had happened."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

pytest.importorskip("llm")
sqlite_utils = pytest.importorskip("sqlite_utils")
from llm.logs import LogStore  # noqa: E402

from dagsync.blobs import pack  # noqa: E402
from dagsync.unpack import unpack  # noqa: E402
from dagsync.merge import merge  # noqa: E402
from dagsync.verify import verify  # noqa: E402
from tests.test_real_llm_merge import cli, machines, responses  # noqa: E402, F401 - the machines fixture


def test_llm_reads_packed_merged_unpacked_files_as_before(tmp_path, machines):  # noqa: F811
    plain = tmp_path / "plain" / "logs.db"
    plain.parent.mkdir()
    merge(plain, machines)
    expected = responses(plain)

    copies = []
    for n, machine in enumerate(machines):
        copy = tmp_path / f"m{n}" / "logs.db"
        copy.parent.mkdir()
        shutil.copyfile(machine, copy)
        if n != 1:  # one of them stays unpacked: every combination meets in the merge
            report = pack(copy, threshold=73, dictionary=n == 0)
            assert report.payload_bytes > 0
            assert verify(copy).problems == ()
        copies.append(copy)
    target = tmp_path / "target" / "logs.db"
    target.parent.mkdir()
    shutil.copyfile(copies[0], target)  # a packed target
    merge(target, copies[1:])
    with sqlite3.connect(target) as conn:
        assert conn.execute("SELECT count(*) FROM blobs").fetchone()[0] > 0
    assert verify(target).problems == ()

    unpack(target)
    assert verify(target).problems == ()
    listed = responses(target)
    assert set(listed) == set(expected)
    for rid, row in expected.items():
        assert (listed[rid]["prompt"], listed[rid]["response"]) == (row["prompt"], row["response"])
    assert LogStore(sqlite_utils.Database(target)).verify() == []
    # pack dropped the full-text index over the packed responses; unpack made it
    # again, so llm's own search finds what it finds in the file never packed.
    for path, has_index in ((copies[0], 0), (target, 1)):  # packed, and unpacked
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'responses_fts'").fetchone() == (has_index,)
    for word in ("alpaca", "zeppelin", "shared", "terse"):
        found = {r["id"] for r in json.loads(cli(target.parent, "logs", "list", "-q", word, "--json", "-n", "0", "-d", str(target)))}
        assert found and found == {
            r["id"] for r in json.loads(cli(plain.parent, "logs", "list", "-q", word, "--json", "-n", "0", "-d", str(plain)))
        }, word  # fmt: skip
    for copy in copies:  # and each packed machine, unpacked on its own
        unpack(copy)
        assert LogStore(sqlite_utils.Database(copy)).verify() == []
    done = subprocess.run(
        [sys.executable, "-m", "llm", "-m", "echo", "-c", "still talking after all that"],
        env={"LLM_USER_PATH": str(target.parent), "PATH": ""}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_llm_reads_a_long_prompt_back_after_pack_and_unpack(tmp_path):
    """A 10 MB prompt (and echo's 10 MB answer) goes through pack and unpack in
    pieces (dagsync.streamed); llm then lists and verifies the file as before."""
    user = tmp_path / "user"
    user.mkdir()
    document = "".join(f"line {n}: the long document llm was asked about.\n" for n in range(200_000))
    assert len(document.encode()) > 9 * 2**20
    subprocess.run(
        [sys.executable, "-m", "llm", "-m", "echo"], input=document, text=True, check=True, capture_output=True,
        env={**os.environ, "LLM_USER_PATH": str(user)},
    )  # fmt: skip
    db = user / "logs.db"
    before = responses(db)
    packed = tmp_path / "packed.db"
    report = pack(db, output=packed)
    with sqlite3.connect(packed) as conn:
        (long_blobs,) = conn.execute("SELECT count(*) FROM blobs WHERE size > 8388608").fetchone()
    conn.close()
    assert long_blobs >= 1 and report.payload_bytes > len(document.encode())
    assert verify(packed).problems == ()
    unpack(packed)
    assert responses(packed) == before
    assert LogStore(sqlite_utils.Database(packed)).verify() == []
