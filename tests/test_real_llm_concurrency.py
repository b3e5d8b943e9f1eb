"""Guarantee 7 with the real client: llm keeps logging to the target during a
large merge, and during a large forget."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dagsync.forget import Selector, forget
from dagsync.merge import merge
from dagsync.verify import verify

pytest.importorskip("llm")
from fixtures import family_llm  # noqa: E402


class Prompter:
    """One llm process at a time, prompting in a loop, as a person at a terminal runs it.

    (Two llm processes can fail each other: llm reads, then upgrades to write,
    in a deferred transaction; two doing that at once is refused by SQLite
    whoever else holds the file. See docs/merge.md.)
    """

    def __init__(self, env: dict[str, str], during: str) -> None:
        self.env, self.during = env, during
        self.sent: list[tuple[str, float, float]] = []
        self.failures: list[str] = []
        self.windows: list[tuple[float, float]] = []  # when the operation ran
        self.done = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.done.is_set():
            n += 1
            prompt = f"live prompt number {n} during the {self.during}"
            began = time.perf_counter()
            run = subprocess.run(
                [sys.executable, "-m", "llm", "-m", "echo", prompt], env=self.env, capture_output=True, text=True
            )
            if run.returncode:
                self.failures.append(run.stderr)
            else:
                self.sent.append((prompt, began, time.perf_counter()))

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.windows.append((started, time.perf_counter()))

    def inside(self) -> list[str]:
        """The prompts that ran entirely inside the operation."""
        return [p for p, began, ended in self.sent if any(began > start and ended < end for start, end in self.windows)]

    def logged(self) -> set[str]:
        listed = subprocess.run(
            [sys.executable, "-m", "llm", "logs", "list", "--json", "-n", "0"], env=self.env,
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        return {r["prompt"] for r in json.loads(listed)}


@contextlib.contextmanager
def prompting(user_dir: Path, during: str) -> Iterator[Prompter]:
    prompter = Prompter({**os.environ, "LLM_USER_PATH": str(user_dir)}, during)
    thread = threading.Thread(target=prompter.run)
    thread.start()
    try:
        time.sleep(1.0)  # llm is already writing when the operation starts
        yield prompter
        time.sleep(1.0)
    finally:
        # Even when the operation failed: a prompter left running keeps the test run alive.
        prompter.done.set()
        thread.join()


def llm_verifies(target: Path) -> None:
    import sqlite_utils
    from llm.logs import LogStore

    assert LogStore(sqlite_utils.Database(target)).verify() == []


def test_llm_prompts_during_a_merge_never_hit_a_locked_database(tmp_path):
    # Several sources, merged one after another until enough prompts ran
    # entirely inside a merge: a fast machine merges one in ~3 s, and the
    # test must not depend on how fast this machine is.
    machines = [r.path for r in family_llm(tmp_path / "fam", seed=71, machines=5, conversations=7000)]
    user_dir = tmp_path / "llm"
    user_dir.mkdir()
    target = user_dir / "logs.db"
    shutil.copyfile(machines[0], target)
    with prompting(user_dir, "merge") as prompter:
        for source in machines[1:]:
            with prompter.timed():
                report = merge(target, [source])
            assert report.sources[0].table("messages").added > 0
            if len(prompter.inside()) >= 3:
                break
    assert prompter.failures == [], prompter.failures[0]
    merging = sum(end - start for start, end in prompter.windows)
    assert len(prompter.inside()) >= 3, f"only {len(prompter.inside())} prompts ran inside {merging:.1f}s of merging"
    assert {p for p, _, _ in prompter.sent} <= prompter.logged()
    llm_verifies(target)


def test_llm_prompts_during_a_large_forget_never_fail(tmp_path):
    # A sixth of the threads per forget, until enough prompts ran entirely
    # inside one; the threads llm's prompts start are never among them.
    (machine,) = [r.path for r in family_llm(tmp_path / "fam", seed=72, machines=1, conversations=9000)]
    user_dir = tmp_path / "llm"
    user_dir.mkdir()
    target = user_dir / "logs.db"
    shutil.copyfile(machine, target)
    with sqlite3.connect(target) as conn:
        batches = [[t for (t,) in conn.execute("SELECT id FROM threads WHERE rowid % 6 = ?", (k,))] for k in range(6)]
    forgotten: set[str] = set()
    with prompting(user_dir, "forget") as prompter:
        for batch in batches:
            with prompter.timed():
                report = forget(target, Selector(ids=tuple(batch)))
            assert len(report.conversations) >= len(batch) and report.messages > 0
            forgotten |= {c.id for c in report.conversations}
            if len(prompter.inside()) >= 3:
                break
    assert prompter.failures == [], prompter.failures[0]
    forgetting = sum(end - start for start, end in prompter.windows)
    assert len(prompter.inside()) >= 3, f"only {len(prompter.inside())} prompts ran inside {forgetting:.1f}s of forgetting"
    assert {p for p, _, _ in prompter.sent} <= prompter.logged()
    with sqlite3.connect(target) as conn:
        assert not forgotten & {t for (t,) in conn.execute("SELECT id FROM threads")}
    llm_verifies(target)
    assert verify(target).problems == ()
