"""How keyed rows are inserted: skipping the keys the target has by the key's
unique index (``ON CONFLICT (key) DO NOTHING``), and falling back to ``NOT
EXISTS`` where that index would not say the same (keyed.plan).

An insert that reads the table it writes makes SQLite store every selected
row first; a large attachment was then held in memory four times over.
"""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dagsync.merge import merge
from dagsync.store import MessageStore

MIB = 1024 * 1024


def test_a_response_with_a_null_id_is_copied_once_and_never_again(tmp_path):
    # IS matches NULL to NULL and a unique index does not: the fallback keeps
    # a re-merge writing nothing (with the index alone, every run would add it).
    source, target = tmp_path / "src.db", tmp_path / "t.db"
    with MessageStore.open(source) as s:
        s.conn.execute("INSERT INTO responses (id, prompt) VALUES (NULL, 'no id')")
        s.conn.execute("INSERT INTO responses (id, prompt) VALUES ('r1', 'an id')")
    assert merge(target, [source]).sources[0].written == 2
    assert merge(target, [source], full=True).sources[0].written == 0
    with sqlite3.connect(target) as conn:
        assert conn.execute("SELECT prompt FROM responses ORDER BY prompt").fetchall() == [("an id",), ("no id",)]


def _peak_rss_of_merge(target: Path, source: Path) -> int:
    """Peak RSS (bytes) of a child process that merges ``source`` into ``target``."""
    code = textwrap.dedent(
        f"""
        from dagsync.merge import merge
        merge({str(target)!r}, [{str(source)!r}])
        status = open("/proc/self/status").read()
        print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_large_attachment_is_not_held_in_memory_over_and_over(tmp_path):
    # The same merge with and without one 64 MiB attachment: SQLite itself
    # holds it twice (the value read, the record written) and its proof once
    # more; the temp table of every selected row made it four times and more.
    size = 64 * MIB
    content = bytes(range(256)) * (size // 256)
    plain, heavy = tmp_path / "plain.db", tmp_path / "heavy.db"
    for path, attachment in ((plain, b"small"), (heavy, content)):
        with MessageStore.open(path) as s:
            s.conn.execute("INSERT INTO responses (id, prompt) VALUES ('r1', 'see the file')")
            s.conn.execute(
                "INSERT INTO attachments (id, type, content) VALUES (?, 'application/pdf', ?)",
                (hashlib.sha256(attachment).hexdigest(), attachment),
            )
    extra = _peak_rss_of_merge(tmp_path / "t-heavy.db", heavy) - _peak_rss_of_merge(tmp_path / "t-plain.db", plain)
    assert extra < 3.5 * size, f"the attachment cost {extra / size:.1f} times its size in memory"
    with sqlite3.connect(tmp_path / "t-heavy.db") as conn:
        assert conn.execute("SELECT length(content) FROM attachments").fetchone() == (size,)
