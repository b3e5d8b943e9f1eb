"""Payloads longer than ``packed.ONE_SHOT`` (8 MiB) pass through pack and unpack in pieces.

A 100 MB attachment or a 12 MB document is hashed, compressed, written to
the store, proven and written back a piece at a time (``dagsync.streamed``),
so it does not make memory jump (issue 5/6): measured here in a child
process, as ``VmHWM``, against what the same command takes on the file
without it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dagsync.blobs import pack
from dagsync.errors import BlobError
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore
from dagsync.unpack import unpack
from dagsync.verify import verify
from fixtures import family

ATTACHMENT = 100_000_000
DOCUMENT = 12_000_000

MEASURED = r"""
import json, sys
from typer.testing import CliRunner
from dagsync.cli import app
result = CliRunner().invoke(app, sys.argv[1:])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
print(json.dumps([result.exit_code, result.stderr, hwm]))
"""


def measured(*args: str) -> tuple[int, str, float]:
    import json

    out = subprocess.run([sys.executable, "-c", MEASURED, *args], capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


def long_values(path: Path) -> None:
    """A 100 MB attachment (half random, half zeros) and a 12 MB document in a message part."""
    data = os.urandom(ATTACHMENT // 2) + bytes(ATTACHMENT // 2)
    document = ("A long document, line after line. " * (DOCUMENT // 34 + 1))[:DOCUMENT - 2] + "é"  # DOCUMENT bytes of UTF-8
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO attachments (id, type, content) VALUES (?, 'application/octet-stream', ?)",
            (hashlib.sha256(data).hexdigest(), data),
        )
    conn.close()
    with MessageStore.open(path) as store:
        head = store.save_chain([Message("user", [TextPart(document)])])
        store.start_conversation(name="a long document", model="echo", head_message_id=head)


def digests(path: Path) -> list[tuple]:
    """What llm reads of every attachment and part, as hashes (the values are long)."""
    with sqlite3.connect(path) as conn:
        conn.create_function("sha", 1, lambda v: None if v is None else hashlib.sha256(v).hexdigest())
        rows = [
            *conn.execute("SELECT id, typeof(content), length(content), sha(CAST(content AS BLOB)) FROM attachments ORDER BY id"),
            *conn.execute("SELECT id, typeof(content), length(content), sha(CAST(content AS BLOB)) FROM message_parts ORDER BY id"),
        ]
    conn.close()
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    """(the file with long values, the same family file without them)."""
    directory = tmp_path_factory.mktemp("long")
    plain = family(directory / "fam", seed=2, machines=1, conversations=20)[0].path
    path = directory / "long.db"
    shutil.copyfile(plain, path)
    long_values(path)
    return path, plain


def test_long_payloads_pack_and_unpack_whole_in_pieces(files, tmp_path):
    source, _ = files
    path = tmp_path / "l.db"
    shutil.copyfile(source, path)
    before = digests(path)
    report = pack(path, dictionary=True)
    with sqlite3.connect(path) as conn:
        long_blobs = conn.execute("SELECT size, dict FROM blobs WHERE size > 8388608 ORDER BY size").fetchall()
    conn.close()
    assert long_blobs == [(DOCUMENT, None), (ATTACHMENT, None)]  # each one frame, no dictionary
    assert report.payload_bytes > ATTACHMENT + DOCUMENT
    assert verify(path).problems == ()
    assert pack(path).new_blobs == 0  # nothing left to do
    unpack(path)
    assert digests(path) == before  # byte for byte, TEXT stays TEXT, BLOB stays BLOB
    assert verify(path).problems == ()


def test_a_long_payload_does_not_make_memory_jump(files, tmp_path):
    source, plain = files
    runs = {}
    for name, original in (("long", source), ("plain", plain)):
        path = tmp_path / f"{name}.db"
        shutil.copyfile(original, path)
        runs[name] = [measured(command, str(path)) for command in ("pack", "verify", "unpack")]
        assert [code for code, _, _ in runs[name]] == [0, 0, 0], runs[name]
    # pack and unpack: within 60 MB of the same run without the long payloads,
    # most of it SQLite's page cache (32 MiB), which the small file never fills;
    # the payloads are 112 MB, and before 2026-12-07 took 280 and 510 MB more.
    print({name: [round(hwm) for _, _, hwm in run] for name, run in runs.items()})
    for command, long_run, plain_run in zip(("pack", "verify", "unpack"), runs["long"], runs["plain"]):
        if command != "verify":
            assert long_run[2] < plain_run[2] + 60, (command, long_run[2], plain_run[2])


def test_a_damaged_long_blob_is_named_and_unpack_writes_nothing(files, tmp_path):
    source, _ = files
    path = tmp_path / "l.db"
    shutil.copyfile(source, path)
    pack(path)
    with sqlite3.connect(path) as conn:
        (key,) = conn.execute(f"SELECT hash FROM blobs WHERE size = {ATTACHMENT}").fetchone()
        # One byte changed in the middle of its frame (the zero half compresses to little: the random half).
        conn.execute(
            "UPDATE blobs SET data = substr(data, 1, 20000000) || X'00' || substr(data, 20000002) WHERE hash = ?", (key,)
        )
    conn.close()
    problems = [p for p in verify(path).problems if p.check == "blobs"]
    assert [p.key for p in problems] == [key]
    before = path.read_bytes()
    with pytest.raises(BlobError) as info:
        unpack(path)
    assert str(info.value).startswith(f"{path}: blob {key} ")
    assert str(info.value).endswith(
        "; its blob store is damaged and nothing was written - "
        f"run `dagsync verify {path}` to see all of it, and restore the file from a backup"
    )
    assert path.read_bytes() == before
