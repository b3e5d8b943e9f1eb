"""The consolidation commands as users meet them: marks, bundle, push and pull
on every path - success, --help, no arguments, a usage error, a DagsyncError -
through `dagsync` and through `llm dagsync`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dagsync.merge import merge
from tests.test_fork_histories import machines, prompt

COMMANDS = ("push", "pull", "marks", "bundle")


def run(*args: str, llm: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    base = [sys.executable, "-m", "llm", "dagsync"] if llm else [sys.executable, "-m", "dagsync"]
    return subprocess.run([*base, *args], capture_output=True, text=True, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("llm", [False, True])
@pytest.mark.parametrize("command", COMMANDS)
def test_help_explains_each_command(command, llm):
    if llm:
        pytest.importorskip("llm")
    done = run(command, "--help", llm=llm)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Usage: {'llm dagsync' if llm else 'dagsync'} {command} [OPTIONS]")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("push",), "Missing argument '[SOURCE] [USER@]HOST:PATH'."),
        (("pull",), "Missing argument '[USER@]HOST:PATH [TARGET]'."),
        (("push", "nohost"), "Invalid value for [USER@]HOST:PATH: nohost is not [USER@]HOST:PATH"),
        (("pull", "a.db", "b.db"), "Invalid value for [USER@]HOST:PATH: a.db is not [USER@]HOST:PATH"),
        (("bundle",), "Missing argument '[SOURCE] OUT'."),
        (("sync", "h1:a.db", "h2:b.db"), "Invalid value for A B: at most one of A and B may be on another machine"),
    ],
)
def test_usage_errors_exit_2_saying_what_was_wrong(args, message, tmp_path):
    done = run(*args, env={"LLM_USER_PATH": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"Error: {message}"


def test_marks_then_a_bundle_then_its_merge_from_the_command_line(tmp_path):
    with machines() as (files, clock):
        laptop, server, _ = files
        merge(server, [laptop])
        none = run("marks", str(tmp_path / "nothing.db"))
        assert none.stdout.strip() == f"{tmp_path / 'nothing.db'}: no such database yet (a push creates it)"
        listed = run("marks", str(server))
        assert listed.returncode == 0 and listed.stdout.startswith(f"{server}: marks of 1 source(s)")
        doc = run("marks", "--json", str(server))
        (tmp_path / "marks.json").write_text(doc.stdout)
        assert json.loads(doc.stdout)["sources"][0]["label"] == "laptop"
        prompt(laptop, clock, 0, "carried on a stick")
        out = tmp_path / "b.db"
        made = run("bundle", str(laptop), str(out), "--marks", str(tmp_path / "marks.json"), "--json")
        assert made.returncode == 0, made.stderr
        report = json.loads(made.stdout)
        assert report["rows"]["calls"] == 1 and report["why_whole"] is None
        assert oct(out.stat().st_mode & 0o777) == "0o600"
        again = run("bundle", str(laptop), str(out))
        assert (again.returncode, again.stderr.strip()) == (1, f"Error: {out} exists; give a new file for the bundle")
        merged = run("merge", str(server), str(out), "--json")
        assert merged.returncode == 0, merged.stderr
        assert json.loads(merged.stdout)["sources"][0]["incremental"] is True
        # The same bundle again: its rows are there; a second merge writes nothing.
        assert json.loads(run("merge", str(server), str(out), "--json").stdout)["sources"][0]["tables"][0]["added"] == 0


def test_a_bundle_for_another_target_is_refused_whole(tmp_path):
    with machines() as (files, clock):
        laptop, server, desk = files
        merge(server, [laptop])
        (tmp_path / "marks.json").write_text(run("marks", "--json", str(server)).stdout)
        prompt(laptop, clock, 0, "for the server")
        out = tmp_path / "b.db"
        assert run("bundle", str(laptop), str(out), "--marks", str(tmp_path / "marks.json")).returncode == 0
        before = desk.read_bytes()
        done = run("merge", str(desk), str(out))
        assert done.returncode == 1
        assert done.stderr.strip() == (
            f"Error: {out} was made against marks the target does not hold (it has not merged the rows the "
            "bundle leaves out, or has lost them since); nothing was merged - make a new bundle against the "
            "target's marks now (`dagsync marks TARGET`, then `dagsync bundle`)"
        )
        assert desk.read_bytes() == before


def test_bad_marks_are_one_line(tmp_path):
    with machines() as (files, _):
        (tmp_path / "marks.json").write_text("not json")
        done = run("bundle", str(files[0]), str(tmp_path / "b.db"), "--marks", str(tmp_path / "marks.json"))
        assert (done.returncode, done.stderr.strip()) == (
            1, f"Error: {tmp_path / 'marks.json'} is not the JSON `dagsync marks --json` prints"
        )  # fmt: skip
        assert not (tmp_path / "b.db").exists()


def test_a_damaged_bundle_is_refused_whole(tmp_path):
    """A bundle arrives from another machine: every message it brings is proven
    by its key, as a merge's are, and one that fails stops it before a write."""
    import sqlite3

    with machines() as (files, clock):
        laptop, server, _ = files
        merge(server, [laptop])
        (tmp_path / "marks.json").write_text(run("marks", "--json", str(server)).stdout)
        prompt(laptop, clock, 0, "carried on a stick")
        out = tmp_path / "b.db"
        assert run("bundle", str(laptop), str(out), "--marks", str(tmp_path / "marks.json")).returncode == 0
        with sqlite3.connect(out) as conn:
            (key,) = conn.execute("SELECT message_id FROM message_parts WHERE content = 'carried on a stick'").fetchone()
            conn.execute("UPDATE message_parts SET content = 'carried on a stack' WHERE message_id = ?", (key,))
        conn.close()
        before = server.read_bytes()
        done = run("merge", str(server), str(out))
        assert done.returncode == 1
        assert done.stderr.startswith(f"Error: {out}: message {key} does not match its key: its parts hash to ")
        assert done.stderr.endswith(
            f"; it was not copied, and nothing was merged - run `dagsync verify {out}` to see every damaged row, "
            "and restore the source from a backup\n"
        )
        assert done.stderr.count("\n") == 1
        assert server.read_bytes() == before


@pytest.mark.parametrize("llm", [False, True])
def test_a_packed_source_is_not_bundled_and_nothing_is_written(tmp_path, llm):
    """A bundle carries rows, not the blob store a packed file's rows refer to:
    made anyway, its references would reach the target as payloads."""
    if llm:
        pytest.importorskip("llm")
    from dagsync.blobs import pack

    with machines() as (files, _):
        laptop = files[0]
        pack(laptop, threshold=73)
        out = tmp_path / "b.db"
        done = run("bundle", str(laptop), str(out), llm=llm)
        assert (done.returncode, done.stderr.strip()) == (1, (
            f"Error: {laptop} is packed (dagsync pack): a bundle carries rows but not the blob store they refer to; "
            f"merge {laptop} itself (merge reads packed files), or unpack a copy of it and bundle that"
        ))  # fmt: skip
        assert not out.exists()
