"""Guarantee 7 with the real client: llm keeps logging to the target during a large merge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from dagsync.merge import merge

pytest.importorskip("llm")
from fixtures import family_llm  # noqa: E402


def test_llm_prompts_during_a_merge_never_hit_a_locked_database(tmp_path):
    # Several sources, merged one after another until enough prompts ran
    # entirely inside a merge: a fast machine merges one in ~3 s, and the
    # test must not depend on how fast this machine is.
    machines = [r.path for r in family_llm(tmp_path / "fam", seed=71, machines=5, conversations=7000)]
    user_dir = tmp_path / "llm"
    user_dir.mkdir()
    target = user_dir / "logs.db"
    shutil.copyfile(machines[0], target)
    env = {**os.environ, "LLM_USER_PATH": str(user_dir)}
    sent: list[tuple[str, float, float]] = []
    failures: list[str] = []
    done = threading.Event()

    def keep_prompting(who: str) -> None:
        n = 0
        while not done.is_set():
            n += 1
            prompt = f"live prompt number {n} from {who} during the merge"
            began = time.perf_counter()
            run = subprocess.run(
                [sys.executable, "-m", "llm", "-m", "echo", prompt], env=env, capture_output=True, text=True
            )
            if run.returncode:
                failures.append(run.stderr)
            else:
                sent.append((prompt, began, time.perf_counter()))

    # One llm process at a time, as a person at a terminal runs it. (Two llm
    # processes can fail each other: llm reads, then upgrades to write, in a
    # deferred transaction; two doing that at once is refused by SQLite
    # whoever else holds the file. See docs/merge.md.)
    prompters = [threading.Thread(target=keep_prompting, args=("alice",))]
    for prompter in prompters:
        prompter.start()
    time.sleep(1.0)  # llm is already writing when the merge starts
    windows: list[tuple[float, float]] = []

    def inside_a_merge() -> list[str]:
        return [p for p, began, ended in sent if any(began > start and ended < end for start, end in windows)]

    try:
        for source in machines[1:]:
            started = time.perf_counter()
            report = merge(target, [source])
            windows.append((started, time.perf_counter()))
            assert report.sources[0].table("messages").added > 0
            if len(inside_a_merge()) >= 3:
                break
        time.sleep(1.0)
    finally:
        # Even when the merge failed: a prompter left running keeps the test run alive.
        done.set()
        for prompter in prompters:
            prompter.join()
    assert failures == [], failures[0]
    merging = sum(end - start for start, end in windows)
    assert len(inside_a_merge()) >= 3, f"only {len(inside_a_merge())} prompts ran inside {merging:.1f}s of merging"
    listed = json.loads(
        subprocess.run(
            [sys.executable, "-m", "llm", "logs", "list", "--json", "-n", "0"], env=env,
            check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    prompts = {r["prompt"] for r in listed}
    assert {p for p, _, _ in sent} <= prompts
    import sqlite_utils
    from llm.logs import LogStore

    assert LogStore(sqlite_utils.Database(target)).verify() == []
