"""The blob store with the real client: llm's own databases, packed, merged and
unpacked, read by llm as if nothing had happened."""

from __future__ import annotations

import json
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
