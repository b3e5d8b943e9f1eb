"""push and pull of real llm 0.36 files over a real sshd, with llm prompting on
the receiving machine's database all the while: no prompt fails, every one
of them is there afterwards, and so is everything pushed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("llm")
sqlite_utils = pytest.importorskip("sqlite_utils")
from llm.logs import LogStore  # noqa: E402

from dagsync.remote import Remote, Transport, pull, push  # noqa: E402
from tests.sshd import server  # noqa: F401, E402  (the fixture)
from tests.test_real_llm_merge import prompt, responses  # noqa: E402

LOOP = """
import os, subprocess, sys
for i in range(int(sys.argv[1])):
    done = subprocess.run([sys.executable, "-m", "llm", "-m", "echo", f"server prompt {i}"], capture_output=True, text=True)
    if done.returncode:
        print(f"prompt {i} failed: {done.stderr}", flush=True)
        sys.exit(1)
    print(i, flush=True)
"""


def test_pushes_beside_a_prompting_llm_lose_nothing_and_fail_no_prompt(server, tmp_path):
    laptop, far_home = tmp_path / "laptop", tmp_path / "server"
    prompt(laptop, "-s", "You are terse.", "hello from the laptop")
    shutil.copytree(laptop, far_home)
    prompt(far_home, "the server's own thread")
    transport = Transport(server.rsh, server.remote_dagsync)
    target = Remote(server.host, str(far_home))  # an llm home directory: its logs.db
    loop = subprocess.Popen(
        [sys.executable, "-c", LOOP, "12"], env={**os.environ, "LLM_USER_PATH": str(far_home)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    pushes = 0
    try:
        while loop.poll() is None or pushes < 3:
            prompt(laptop, "-c", f"the laptop goes on, {pushes}")
            push(laptop / "logs.db", target, transport)
            pushes += 1
            time.sleep(0.1)
    finally:
        out = loop.communicate(timeout=120)[0]
    assert loop.returncode == 0, out
    pulled = pull(target, laptop / "logs.db", transport)
    assert pulled.written > 0
    held = {r["prompt"] for r in responses(far_home / "logs.db").values()}
    assert {f"server prompt {i}" for i in range(12)} <= held
    assert set(responses(laptop / "logs.db")) == set(responses(far_home / "logs.db"))
    for home in (laptop, far_home):
        assert LogStore(sqlite_utils.Database(home / "logs.db")).verify() == []
