"""push, pull and sync over a real OpenSSH server on 127.0.0.1 (tests/sshd.py).

The "other machine" is this one, reached through ssh with its own keys, and
running dagsync there as ``python -m dagsync`` (``--remote-dagsync``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dagsync.merge import merge
from dagsync.merge.core import source_label
from dagsync.remote import Remote, Transport, pull, push, sync
from dagsync.verify import verify
from fixtures.llm_format import grow_llm
from tests import sshd
from tests.sshd import server  # noqa: F401  (the fixture)
from tests.llm_history import llm_machines, logs_rm
from tests.processes import with_terminal_stderr
from tests.test_fork_histories import machines, prompt
from tests.test_gc_crash import roll_back
from tests.test_incremental import forget, rows

CUT = Path(__file__).with_name("cut_rsh.py")


@pytest.fixture
def transport(server) -> Transport:
    return Transport(server.rsh, server.remote_dagsync)


def far(server, path: Path) -> Remote:
    return Remote(server.host, str(path))


def dagsync(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dagsync", *args], capture_output=True, text=True)


def test_push_creates_the_far_database_then_sends_only_what_is_new(server, transport, tmp_path):
    with machines() as (files, clock):
        laptop, _, _ = files
        hub = tmp_path / "hub.db"
        first = push(laptop, far(server, hub), transport)
        assert (first.against, first.why_whole) == (None, "a new target")
        assert stat.S_IMODE(hub.stat().st_mode) == 0o600
        assert rows(hub)["calls"] == rows(laptop)["calls"]
        prompt(laptop, clock, 0, "more")
        reference = tmp_path / "reference.db"
        shutil.copyfile(hub, reference)
        second = push(laptop, far(server, hub), transport)
        assert second.against == f"{socket.gethostname()}:{laptop.resolve()}" and second.why_whole is None
        assert second.rows["messages"] == 2 and second.rows["calls"] == 1
        assert second.sent_bytes < first.sent_bytes
        merge(reference, [laptop], full=True, target_label="hub")
        assert rows(hub) == rows(reference)
        third = push(laptop, far(server, hub), transport)
        assert third.written == 0 and sum(third.rows.values()) == 0
        assert verify(hub).problems == ()


def test_pull_and_sync_make_both_sides_hold_one_history(server, transport, tmp_path):
    with machines() as (files, clock):
        laptop, desk, _ = files
        hub = tmp_path / "hub.db"
        push(laptop, far(server, hub), transport)
        prompt(desk, clock, 0, "desk")  # the same conversation, on another branch
        prompt(laptop, clock, 0, "laptop")
        push(laptop, far(server, hub), transport)
        pulled = pull(far(server, hub), desk, transport)
        assert pulled.written > 0
        report = sync(desk, far(server, hub), transport)
        assert report.pushed.written > 0
        again = sync(desk, far(server, hub), transport)
        assert again.pulled.written == 0 and again.pushed.written == 0
        mine, theirs = rows(desk), rows(hub)
        for table in ("messages", "message_parts", "calls", "conversations"):
            assert mine[table] == theirs[table], table


def test_the_command_line_and_the_llm_plugin_push_and_pull(server, tmp_path):
    with machines() as (files, clock):
        laptop, desk, _ = files
        hub = tmp_path / "hub.db"
        ssh = ["-e", server.rsh, "--remote-dagsync", server.remote_dagsync]
        done = dagsync("push", str(laptop), f"{server.host}:{hub}", *ssh, "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["direction"] == "push" and report["why_whole"] == "a new target"
        done = dagsync("push", str(laptop), f"{server.host}:{hub}", *ssh)
        (line,) = done.stdout.splitlines()
        assert re.fullmatch(
            re.escape(f"{laptop} -> {server.host}:{hub}: nothing new to push (") + r"[\d,]+ bytes sent, [\d,]+ uncompressed\)",
            line,
        ), line
        prompt(laptop, clock, 1, "dry")
        dry = dagsync("push", str(laptop), f"{server.host}:{hub}", *ssh, "--dry-run", "--json")
        assert json.loads(dry.stdout)["rows"]["calls"] == 1 and json.loads(dry.stdout)["merged"] is None
        quiet = dagsync("pull", f"{server.host}:{hub}", str(desk), *ssh, "--quiet")
        assert (quiet.returncode, quiet.stdout) == (0, "")
        plugin = subprocess.run(
            [sys.executable, "-m", "llm", "dagsync", "push", str(laptop), f"{server.host}:{hub}", *ssh, "--json"],
            capture_output=True, text=True,
        )  # fmt: skip
        if plugin.returncode == 0:
            assert json.loads(plugin.stdout)["rows"]["calls"] == 1
        else:
            pytest.importorskip("llm")
            raise AssertionError(f"exit {plugin.returncode}: {plugin.stderr}")


def test_push_and_pull_tell_progress_each_step_in_order(server, transport, tmp_path):
    with machines() as (files, clock):
        laptop, desk, _ = files
        hub = tmp_path / "hub.db"
        heard: list[tuple[str, int, int]] = []
        push(laptop, far(server, hub), transport, progress=lambda *step: heard.append(step))
        phases = [phase for phase, _, _ in heard]
        steps = [f"asking {server.host} for marks", "making the bundle", "sending", f"merging on {server.host}"]
        assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] == steps
        sending = [(done, total) for phase, done, total in heard if phase == "sending"]
        assert sending[-1][0] == sending[-1][1] > 0
        assert [done for done, _ in sending] == sorted(done for done, _ in sending)
        heard.clear()
        pull(far(server, hub), desk, transport, progress=lambda *step: heard.append(step))
        phases = [phase for phase, _, _ in heard]
        assert phases[0] == f"{server.host} makes the bundle" and "receiving" in phases
        assert phases.index("receiving") < phases.index("copied")  # then the merge's own steps
        receiving = [(done, total) for phase, done, total in heard if phase == "receiving"]
        assert receiving[-1][0] == receiving[-1][1] > 0


def test_on_a_terminal_push_shows_progress_and_piped_it_is_silent(server, tmp_path):
    with machines() as (files, clock):
        laptop = files[0]
        hub = tmp_path / "hub.db"
        argv = [sys.executable, "-m", "dagsync", "push", str(laptop), f"{server.host}:{hub}",
                "-e", server.rsh, "--remote-dagsync", server.remote_dagsync, "--quiet"]  # fmt: skip
        piped = subprocess.run(argv, capture_output=True, text=True)
        assert (piped.returncode, piped.stdout, piped.stderr) == (0, "", "")
        prompt(laptop, clock, 0, "more")
        status, out, shown = with_terminal_stderr(argv)
        assert (status, out) == (0, b"")
        text = shown.decode(errors="replace")
        assert "Traceback" not in text
        assert "\x1b[" in text  # the bar drew (and was cleared: --quiet prints nothing after it)


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("no dagsync", "{host} has no '/nonexistent/dagsync' to run (dagsync is not installed there, or not on the "
         "PATH ssh gives it): install dagsync there, or name it with --remote-dagsync"),
        ("old dagsync", "the dagsync on {host} is too old for push and pull (Error: No such command 'receive'.); upgrade it there"),
        ("host key", "ssh to {host} failed: Host key verification failed.; nothing was written"),
        ("not a database", "on {host}: {hub} is not a SQLite database (it does not start with the SQLite header)"),
    ],
)  # fmt: skip
def test_each_failure_at_the_other_end_is_one_line_and_writes_nothing(server, tmp_path, how, expected):
    with machines() as (files, _):
        laptop = files[0]
        hub = tmp_path / "hub.db"
        rsh, remote = server.rsh, server.remote_dagsync
        if how == "no dagsync":
            remote = "/nonexistent/dagsync"
        elif how == "old dagsync":
            remote = "sh -c 'echo \"Error: No such command '\"'\"'receive'\"'\"'.\" >&2; exit 2' --"
        elif how == "host key":
            wrong = tmp_path / "known_hosts"
            wrong.write_text(f"[127.0.0.1]:{server.port} ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n")
            rsh = rsh.replace(str(Path(rsh.split("UserKnownHostsFile=")[1].split()[0])), str(wrong))
        else:
            hub.write_text("a text file, not a database\n")
        before = laptop.read_bytes()
        done = dagsync("push", str(laptop), f"{server.host}:{hub}", "-e", rsh, "--remote-dagsync", remote)
        assert done.returncode == 1
        line = done.stderr.strip()
        assert "\n" not in line
        assert line.startswith("Error: " + expected.format(host=server.host, hub=hub)), line
        assert laptop.read_bytes() == before
        assert how == "not a database" or not hub.exists()


def _cut(server, direction: str, limit: int) -> Transport:
    return Transport(f"{shlex.quote(sys.executable)} {CUT} {direction} {limit} {server.rsh}", server.remote_dagsync)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_connection_cut_at_any_byte_leaves_the_receiving_side_consistent_and_the_next_run_completes(
    server, transport, tmp_path, direction
):
    rng = random.Random(7)
    with machines() as (files, clock):
        laptop, desk, _ = files
        hub = tmp_path / "hub.db"
        push(laptop, far(server, hub), transport)
        pull(far(server, hub), desk, transport)
        for word in ("a", "b", "c"):
            prompt(laptop, clock, 0, word)
        push(laptop, far(server, hub), transport)
        prompt(laptop, clock, 1, "new")
        receiving = hub if direction == "push" else desk
        # What an uninterrupted run leaves.
        whole = tmp_path / "whole.db"
        shutil.copyfile(receiving, whole)
        if direction == "push":
            size = push(laptop, far(server, whole), transport).sent_bytes
        else:
            size = pull(far(server, hub), whole, transport).sent_bytes
        before = rows(receiving)
        for limit in sorted(rng.sample(range(size), 20)):
            cut = _cut(server, "up" if direction == "push" else "down", limit)
            with pytest.raises(Exception) as failure:
                if direction == "push":
                    push(laptop, far(server, hub), cut)
                else:
                    pull(far(server, hub), desk, cut)
            assert "\n" not in str(failure.value)
            time.sleep(0.1)
            assert verify(receiving).problems == ()
            assert rows(receiving) == before
        if direction == "push":
            push(laptop, far(server, hub), transport)
        else:
            pull(far(server, hub), desk, transport)
        assert rows(receiving) == rows(whole)


def test_no_leftover_files_beside_the_receiving_database(server, transport, tmp_path):
    with machines() as (files, clock):
        laptop = files[0]
        hub = tmp_path / "hub.db"
        push(laptop, far(server, hub), transport)
        prompt(laptop, clock, 0, "x")
        push(laptop, far(server, hub), transport)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hub.db"]
        assert not [p for p in os.listdir(tmp_path) if "dagsync-push" in p]


def _receivers(hub: Path) -> list[int]:
    """The pids of `dagsync receive` processes for ``hub`` (the far end, on this machine)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"receive" in argv and str(hub).encode() in argv:
            found.append(int(entry.name))
    return found


KILLS = int(os.environ.get("DAGSYNC_PUSH_KILLS", 10))


@pytest.mark.parametrize("end", ["pushing", "receiving"])
def test_a_push_killed_at_either_end_leaves_the_target_consistent_and_the_next_push_completes(
    server, transport, tmp_path, end
):
    rng = random.Random(11)
    with machines() as (files, clock):
        laptop = files[0]
        hub = tmp_path / "hub.db"
        push(laptop, far(server, hub), transport)
        for word in ("a", "b", "c", "d"):
            prompt(laptop, clock, word == "d", word)
        whole = tmp_path / "whole.db"
        shutil.copyfile(hub, whole)
        started = time.perf_counter()
        push(laptop, far(server, whole), transport)
        took = time.perf_counter() - started
        before, after = rows(hub), rows(whole)
        shutil.copyfile(hub, tmp_path / "hub-before.db")
        command = [
            sys.executable, "-m", "dagsync", "push", str(laptop), f"{server.host}:{hub}",
            "-e", server.rsh, "--remote-dagsync", server.remote_dagsync, "--quiet",
        ]  # fmt: skip
        killed = 0
        for attempt in range(KILLS):
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            in_flight = end == "receiving" or attempt % 2
            if in_flight:
                # Timed from when the far end has started: ssh alone may take
                # longer than the whole push did, on a loaded machine.
                while proc.poll() is None and not _receivers(hub):
                    time.sleep(0.002)
            # The first kill in flight lands at once, so that one surely
            # interrupts a running transfer whatever the load; the rest anywhere.
            deadline = time.perf_counter() + (0 if attempt == int(end == "pushing") else rng.uniform(0, took))
            while time.perf_counter() < deadline and proc.poll() is None:
                time.sleep(0.005)
            if end == "pushing":
                proc.kill()
            else:
                for pid in _receivers(hub):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            killed += proc.wait() != 0
            for _ in range(200):  # the far end finishes, or notices, and leaves
                if not _receivers(hub):
                    break
                time.sleep(0.05)
            # A receiver killed while writing leaves a hot journal: the next
            # program that opens the file read-write (an llm, the next push)
            # rolls it back; verify, read-only, would only say so.
            roll_back(hub)
            assert verify(hub).problems == ()
            # Consistent, and part of the way: a long transaction commits every
            # few seconds (transactions.LONG_COMMIT_SECONDS), so a kill on a
            # slow machine may land after some tables' commit.
            now = rows(hub)
            assert now.keys() == before.keys()
            for table, found in now.items():
                assert set(found) <= set(before[table]) | set(after[table]), table
            if now != before:  # a kill too late: start again from before
                shutil.copyfile(tmp_path / "hub-before.db", hub)
        assert killed, "no kill interrupted a push: the test proved nothing"
        push(laptop, far(server, hub), transport)
        assert rows(hub) == after


# The law of tests/test_incremental.py across machines: pushes and pulls
# among prompts, deletions with gc, VACUUMs and replaced files; each transfer
# ends where a full merge of the same source into the same target does.
transfers = st.lists(
    st.one_of(
        st.tuples(st.just("prompt"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3)),
        st.permutations(range(3)).map(lambda p: ("push", p[0], p[1])),
        st.permutations(range(3)).map(lambda p: ("pull", p[0], p[1])),
        st.tuples(st.just("rm"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("vacuum"), st.integers(0, 2)),
        st.permutations(range(3)).map(lambda p: ("replace", p[0], p[1])),
    ),
    min_size=3,
    max_size=10,
)


def run_history(server, files: list[Path], history: list[tuple], write, rm) -> None:
    """Run a law's steps: ``write`` a machine's own step (a prompt, llm-like
    writes), ``rm`` a deletion then gc; every push or pull ends as a full
    merge of the same source into the same target leaves it; every file
    passes verify at the end."""
    transport = Transport(server.rsh, server.remote_dagsync)
    for step in history:
        if step[0] in ("push", "pull"):
            _, source, target = step
            full = files[target].with_name("full.db")
            shutil.copyfile(files[target], full)
            if step[0] == "push":
                push(files[source], far(server, files[target]), transport)
            else:
                pull(far(server, files[source]), files[target], transport)
            merge(full, [files[source]], full=True, target_label=source_label(files[target]))
            assert rows(files[target]) == rows(full), step
            full.unlink()
        elif step[0] == "rm":
            rm(files[step[1]], step[2])
        elif step[0] == "vacuum":
            with contextlib.closing(sqlite3.connect(files[step[1]])) as conn:
                conn.execute("VACUUM")
        elif step[0] == "replace":
            shutil.copyfile(files[step[2]], files[step[1]])
        else:
            write(step)
    for path in files:
        assert verify(path).problems == ()


@settings(max_examples=int(os.environ.get("DAGSYNC_PUSH_EXAMPLES", 6)), deadline=None)
@given(history=transfers, seed=st.integers(0, 2**32))
@example(history=[("push", 0, 1), ("prompt", 0, 0, 1), ("push", 0, 1), ("rm", 1, 0), ("pull", 2, 1),
                  ("prompt", 1, 1, 2), ("vacuum", 1), ("pull", 2, 1), ("replace", 0, 2), ("push", 0, 1)], seed=3)  # fmt: skip
def test_any_history_of_pushes_and_pulls_ends_as_full_merges_do(server, history, seed):
    with machines(seed) as (files, clock):

        def write(step: tuple) -> None:
            _, machine, row, words = step
            prompt(files[machine], clock, row, f"w{words}")

        run_history(server, files, history, write, forget)


llm_transfers = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 1), st.integers(0, 1)),
        st.permutations(range(3)).map(lambda p: ("push", p[0], p[1])),
        st.permutations(range(3)).map(lambda p: ("pull", p[0], p[1])),
        st.tuples(st.just("rm"), st.integers(0, 2), st.integers(0, 7)),
        st.tuples(st.just("vacuum"), st.integers(0, 2)),
        st.permutations(range(3)).map(lambda p: ("replace", p[0], p[1])),
    ),
    min_size=3,
    max_size=10,
)


@settings(max_examples=int(os.environ.get("DAGSYNC_PUSH_EXAMPLES", 6)), deadline=None)
@given(history=llm_transfers, seed=st.integers(0, 2**16))
@example(history=[("push", 0, 1), ("grow", 0, 1, 1, 1), ("push", 0, 1), ("rm", 1, 0), ("pull", 2, 1),
                  ("grow", 1, 1, 0, 0), ("vacuum", 1), ("pull", 2, 1), ("replace", 0, 2), ("push", 0, 1)], seed=3)  # fmt: skip
def test_any_llm_history_of_pushes_and_pulls_ends_as_full_merges_do(server, history, seed):
    pytest.importorskip("llm")
    days = itertools.count(400)
    with llm_machines(seed) as files:

        def write(step: tuple) -> None:
            _, machine, continued, new, forks = step
            day = next(days)
            grow_llm(files[machine], seed=seed, stream=day, continued=continued, new=new, forks=forks, day=day)

        run_history(server, files, history, write, logs_rm)



def test_a_push_makes_its_bundle_against_the_marks_the_last_one_left_while_ssh_connects(server, transport, tmp_path, monkeypatch):
    from dagsync.remote import MarksCache

    with machines() as (files, clock):
        laptop, desk, _ = files
        hub = tmp_path / "hub.db"
        first = push(laptop, far(server, hub), transport)
        assert not first.guessed  # nothing remembered yet
        cache = MarksCache(far(server, hub), laptop)
        assert stat.S_IMODE(cache.path.stat().st_mode) == 0o600
        assert cache.read()["sources"][0]["path"].endswith(str(laptop.resolve()))
        prompt(laptop, clock, 0, "guessed")
        second = push(laptop, far(server, hub), transport)
        assert second.guessed and second.rows["calls"] == 1
        # The far side changed since (another source pushed there): the guess is not used.
        push(desk, far(server, hub), transport)
        prompt(laptop, clock, 0, "stale")
        shutil.copyfile(hub, tmp_path / "reference.db")
        third = push(laptop, far(server, hub), transport)
        assert not third.guessed and third.rows["calls"] == 1
        merge(tmp_path / "reference.db", [laptop], full=True, target_label="hub")
        assert rows(hub) == rows(tmp_path / "reference.db")
        # A cache that cannot be read or written costs nothing but the guess.
        cache.path.write_text("not json")
        prompt(laptop, clock, 1, "garbled")
        assert not push(laptop, far(server, hub), transport).guessed
        monkeypatch.setenv("XDG_CACHE_HOME", str(hub))  # a file, not a folder
        prompt(laptop, clock, 1, "unwritable")
        assert push(laptop, far(server, hub), transport).rows["calls"] == 1
