"""``llm dagsync ...`` through the real llm 0.36 CLI behaves as ``dagsync ...``.

llm's command line is click; dagsync's is typer, which carries its own copy
of click since 0.26, so nothing but the plugin's own hand-over can make the
two agree. Every path is tried: help (top level and each command), the
version, no arguments, usage errors, a DagsyncError and success. Each must
print what ``dagsync`` prints (the program name aside) and exit as it does:
0, 1 for an error, 2 for a usage error; and never a traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llm")

COMMANDS = ("stats", "merge", "sync", "canonicalise", "verify", "gc", "pack", "unpack")


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """An llm home with a logs.db llm itself wrote, and a file that is not a database."""
    home = tmp_path_factory.mktemp("plugin")
    env = {**os.environ, "LLM_USER_PATH": str(home)}
    subprocess.run([sys.executable, "-m", "llm", "-m", "echo", "hello plugin"], env=env, check=True, capture_output=True)
    (home / "notes.db").write_text("not a database")
    return home


def both(home: Path, *args: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    env = {**os.environ, "LLM_USER_PATH": str(home), "COLUMNS": "80"}
    env.pop("DAGSYNC_RAISE_ERRORS", None)
    run = lambda *cmd: subprocess.run([sys.executable, "-m", *cmd, *args], env=env, capture_output=True, text=True)  # noqa: E731
    return run("llm", "dagsync"), run("dagsync")


def same(out: str) -> str:
    """Output with the run's own duration left out."""
    return re.sub(r'"seconds": [0-9.]+', '"seconds": ...', out)


CASES = [
    (("--help",), 0),
    (("-h",), 0),
    (("--version",), 0),
    ((), 2),
    *(((command, "--help"), 0) for command in COMMANDS),
    (("merge",), 2),
    (("stats", "a.db", "b.db"), 2),
    (("gc", "--grace", "3x", "--dry-run"), 2),
    (("gc", "--no-such-option"), 2),
    (("stats", "/nonexistent.db"), 1),
    (("verify", "{home}/notes.db"), 1),
    (("stats", "--json"), 0),
    (("verify",), 0),
    (("gc", "--dry-run", "--json"), 0),
]


@pytest.mark.parametrize(("args", "status"), CASES, ids=[" ".join(a) or "no-arguments" for a, _ in CASES])
def test_llm_dagsync_behaves_as_dagsync(home, args, status):
    args = tuple(a.format(home=home) for a in args)
    plugin, own = both(home, *args)
    assert "Traceback" not in plugin.stderr + plugin.stdout, plugin.stderr
    assert (plugin.returncode, own.returncode) == (status, status), (plugin.stderr, own.stderr)
    assert same(plugin.stdout.replace("llm dagsync", "dagsync")) == same(own.stdout)
    assert plugin.stderr.replace("llm dagsync", "dagsync") == own.stderr
    if status == 1:
        assert own.stderr.startswith("Error: ") and own.stderr.count("\n") == 1
    if status == 2:
        assert "Error: " in own.stderr or own.stderr.startswith("Usage: dagsync ")  # no arguments: the help


def test_help_names_the_program_as_llm_does(home):
    plugin, _ = both(home, "merge", "--help")
    assert plugin.stdout.startswith("Usage: llm dagsync merge [OPTIONS] [TARGET] SOURCE...\n")


def test_llm_lists_the_plugin_with_a_one_line_summary(home):
    env = {**os.environ, "LLM_USER_PATH": str(home), "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "llm", "--help"], env=env, capture_output=True, text=True, check=True)
    (line,) = [line for line in done.stdout.splitlines() if line.strip().startswith("dagsync")]
    assert "Merge, deduplicate, pack and garbage-collect" in line
