"""The blob store with the real client: llm's own databases, packed, merged and
unpacked, read by llm as if nothing had happened."""

from __future__ import annotations

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
from tests.test_real_llm_merge import machines, responses  # noqa: E402, F401 - the machines fixture


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
    for copy in copies:  # and each packed machine, unpacked on its own
        unpack(copy)
        assert LogStore(sqlite_utils.Database(copy)).verify() == []
    done = subprocess.run(
        [sys.executable, "-m", "llm", "-m", "echo", "-c", "still talking after all that"],
        env={"LLM_USER_PATH": str(target.parent), "PATH": ""}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
