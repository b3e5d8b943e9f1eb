"""Guarantee 7: a live writer (5 s busy timeout, no retry) never fails during a merge."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import time

from dagsync.merge import merge
from fixtures import family
from tests.history import contains, integrity, logical, union_of

# Writes conversations the way llm does: Python's sqlite3, its default 5 s
# busy timeout, implicit transactions, and no retry of its own. Any error ends
# it with a non-zero status. It stops when the stop file appears.
WRITER = r"""
import sqlite3, sys, time, os, json, hashlib
from dagsync.canonical import content_hash
from dagsync.message import Message, TextPart
from dagsync.store import part_row
target, stop, out = sys.argv[1:4]
conn = sqlite3.connect(target, timeout=5.0)
written = []
n = 0
while not os.path.exists(stop):
    n += 1
    cid = f"writer-conversation-{n:05d}"
    parent = "root"
    for i, (role, text) in enumerate((("user", f"question {n} from the live writer"), ("assistant", f"answer {n}"))):
        m = Message(role, [TextPart(text)])
        mid = f"writer-message-{n:05d}-{i}"
        conn.execute("INSERT INTO messages VALUES (?, ?, ?, ?, NULL, ?)", (mid, parent, content_hash(m), role, "2026-11-30T00:00:00Z"))
        conn.execute("INSERT INTO message_parts VALUES (?, ?, 0, ?, ?, ?, ?, ?)", (mid + "-p", mid, *part_row(m.parts[0])))
        parent = mid
    conn.execute("INSERT INTO conversations (id, name, model, head_message_id) VALUES (?, 'live', 'echo', ?)", (cid, parent))
    conn.commit()
    written.append(cid)
    time.sleep(0.005)
json.dump(written, open(out, "w"))
"""


def test_a_live_writer_never_fails_and_nothing_is_lost(tmp_path):
    machines = [r.path for r in family(tmp_path / "fam", seed=61, machines=2, conversations=2500)]
    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    stop, out = tmp_path / "stop", tmp_path / "written.json"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target), str(stop), str(out)], stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.5)  # the writer is under way before the merge starts
    started = time.perf_counter()
    merge(target, [machines[1]])
    took = time.perf_counter() - started
    time.sleep(0.3)
    stop.touch()
    _, errors = writer.communicate(timeout=60)
    assert writer.returncode == 0, f"the live writer failed: {errors}"
    import json

    written = json.loads(out.read_text())
    assert len(written) > 10, f"the writer barely wrote during the {took:.1f}s merge"
    with sqlite3.connect(target) as conn:
        present = {cid for (cid,) in conn.execute("SELECT id FROM conversations WHERE name = 'live'")}
    assert present == set(written)
    assert integrity(target) == []
    assert contains(logical(target), union_of(logical(machines[0]), logical(machines[1]))) == []
