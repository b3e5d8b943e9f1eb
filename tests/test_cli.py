"""The command line: exact output, exit codes, llm's default database."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dagsync import __version__
from dagsync.cli import app
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore
from tests.processes import with_terminal_stderr

runner = CliRunner()


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env, catch_exceptions=False, prog_name="dagsync")


@pytest.fixture
def dag_file(tmp_path: Path) -> Path:
    path = tmp_path / "dag.db"
    with MessageStore.open(path) as store:
        conversation = store.start_conversation("c", "m")
        head = store.save_chain([Message("user", [TextPart("q")]), Message("assistant", [TextPart("a")])])
        store.advance_conversation(conversation, head)
        store.fork(head, "fork")
        store.save_chain([Message("user", [TextPart("q")]), Message("assistant", [TextPart("b")])])
    return path


class TestStats:
    def test_json(self, dag_file):
        result = run("stats", str(dag_file), "--json")
        assert result.exit_code == 0
        report = json.loads(result.stdout)
        assert report["format"] == "dag"
        assert (report["messages"], report["conversations"], report["chains"], report["forks"]) == (3, 2, 2, 1)
        assert report["tables"]["messages"] == 4  # with the sentinel
        assert report["file_bytes"] == dag_file.stat().st_size

    def test_text(self, dag_file):
        result = run("stats", str(dag_file))
        assert result.exit_code == 0
        lines = result.stdout.splitlines()
        assert lines[0].startswith(f"{dag_file}  (dag format, ")
        assert lines[1].split() == ["conversations", "2"]
        assert any(line.startswith("  rows per table") for line in lines)
        assert [line.split()[:2] for line in lines[2:4]] == [["calls", "0"], ["messages", "3"]]

    def test_an_error_is_one_line_and_exit_1(self, tmp_path):
        bad = tmp_path / "x.db"
        bad.write_text("hello")
        result = run("stats", str(bad))
        assert result.exit_code == 1
        assert result.stderr == f"Error: {bad} is not a SQLite database (it does not start with the SQLite header)\n"
        assert result.stdout == ""

    def test_a_usage_error_is_exit_2(self):
        assert run("stats", "a.db", "b.db").exit_code == 2

    def test_unexpected_errors_are_one_line_unless_asked(self, dag_file, monkeypatch):
        def boom(path):
            raise KeyError("kaput")

        monkeypatch.setattr("dagsync.cli.stats", boom)
        result = run("stats", str(dag_file))
        assert result.exit_code == 1
        assert result.stderr == "Error: unexpected KeyError: 'kaput' (set DAGSYNC_RAISE_ERRORS=1 to see where)\n"
        monkeypatch.setenv("DAGSYNC_RAISE_ERRORS", "1")
        with pytest.raises(KeyError):
            run("stats", str(dag_file))


class TestDefaultDatabase:
    def test_dag_db_is_preferred_to_logs_db(self, tmp_path, dag_file):
        (tmp_path / "logs.db").write_text("not used")
        result = run("stats", "--json", env={"LLM_USER_PATH": str(tmp_path)})
        assert json.loads(result.stdout)["path"] == str(tmp_path / "dag.db")

    def test_logs_db_when_there_is_no_dag_db(self, tmp_path, dag_file):
        dag_file.rename(tmp_path / "logs.db")
        result = run("stats", "--json", env={"LLM_USER_PATH": str(tmp_path)})
        assert json.loads(result.stdout)["path"] == str(tmp_path / "logs.db")

    def test_neither(self, tmp_path):
        result = run("stats", env={"LLM_USER_PATH": str(tmp_path)})
        assert result.exit_code == 1
        assert result.stderr == (
            f"Error: no database given, and llm's directory {tmp_path} has neither dag.db "
            "nor logs.db; pass the database file as an argument\n"
        )


class TestEntryPoints:
    def test_version(self):
        result = run("--version")
        assert (result.exit_code, result.stdout) == (0, f"dagsync {__version__}\n")

    def test_help_lists_the_commands(self):
        result = run("--help")
        assert result.exit_code == 0 and "stats" in result.stdout

    def test_python_dash_m(self, dag_file):
        done = subprocess.run(
            [sys.executable, "-m", "dagsync", "stats", str(dag_file), "--json"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert json.loads(done.stdout)["format"] == "dag"


class TestMerge:
    @pytest.fixture
    def pair(self, tmp_path):
        from fixtures import family

        return [r.path for r in family(tmp_path / "fam", seed=41, machines=2, conversations=30)]

    def test_with_a_terminal_on_stderr_the_json_on_stdout_is_the_report_alone(self, tmp_path, pair):
        """The progress bar draws on stderr (a terminal), never on stdout (a pipe to jq)."""
        status, stdout, drawn = with_terminal_stderr(
            [sys.executable, "-m", "dagsync", "merge", str(tmp_path / "m.db"), *map(str, pair), "--json"]
        )
        out = stdout.decode()
        assert status == 0
        assert json.loads(out)["target"] == str(tmp_path / "m.db")
        assert out == out.strip() + "\n"  # nothing of the bar's
        assert b"\x1b[" in drawn  # the bar drew, on stderr

    def test_text_report_then_nothing_new(self, tmp_path, pair):
        target = tmp_path / "m.db"
        result = run("merge", str(target), *map(str, pair))
        assert result.exit_code == 0
        lines = result.stdout.splitlines()
        assert lines[0].startswith(f"{target}: created from 2 sources in ")
        assert f"  from {pair[0]}:" in lines
        assert any(line.split()[:3] == ["messages", lines_added(line), "added"] for line in lines)
        again = run("merge", str(target), *map(str, pair))
        beyond = "(only what lies beyond the target's marks of it)"
        assert again.stdout.splitlines()[1:] == [
            f"  from {pair[0]} {beyond}:", "    nothing new: the target already holds all of it",
            f"  from {pair[1]} {beyond}:", "    nothing new: the target already holds all of it",
        ]  # fmt: skip
        full = run("merge", str(target), str(pair[0]), "--full")
        assert full.stdout.splitlines()[1] == f"  from {pair[0]} (read whole: --full):"

    def test_json_and_dry_run(self, tmp_path, pair):
        target = tmp_path / "m.db"
        result = run("merge", str(target), str(pair[0]), "--dry-run", "--json")
        report = json.loads(result.stdout)
        assert (report["dry_run"], report["created"]) == (True, True)
        assert report["sources"][0]["tables"][0]["table"] == "messages"
        assert not target.exists()

    def test_quiet_prints_nothing(self, tmp_path, pair):
        result = run("merge", str(tmp_path / "m.db"), str(pair[0]), "--quiet")
        assert (result.exit_code, result.stdout) == (0, "")

    def test_a_missing_source(self, tmp_path, pair):
        result = run("merge", str(tmp_path / "m.db"), str(tmp_path / "nope.db"))
        assert result.exit_code == 1
        assert result.stderr == f"Error: {tmp_path / 'nope.db'}: no such file\n"
        assert not (tmp_path / "m.db").exists()

    def test_no_path_is_a_usage_error(self):
        result = run("merge")
        assert result.exit_code == 2
        assert result.stderr.endswith("Error: Missing argument '[TARGET] SOURCE...'.\n")

    def test_one_path_is_a_source_merged_into_llms_own_database(self, tmp_path, pair):
        home = tmp_path / "home"
        home.mkdir()
        shutil.copyfile(pair[0], home / "dag.db")
        result = run("merge", str(pair[1]), env={"LLM_USER_PATH": str(home)})
        assert result.exit_code == 0, result.stderr
        assert result.stdout.startswith(f"{home / 'dag.db'}: merged 1 source in ")
        assert f"  from {pair[1]}:" in result.stdout.splitlines()
        assert run("merge", str(pair[1]), env={"LLM_USER_PATH": str(home)}).stdout.splitlines()[2] == (
            "    nothing new: the target already holds all of it"
        )

    def test_one_path_and_no_llm_database(self, tmp_path, pair):
        result = run("merge", str(pair[0]), env={"LLM_USER_PATH": str(tmp_path)})
        assert result.exit_code == 1
        assert result.stderr == (
            f"Error: no database given, and llm's directory {tmp_path} has neither dag.db nor logs.db; "
            "pass the database file as an argument\n"
        )

    def test_an_llm_home_directory_names_its_database(self, tmp_path, pair):
        home = tmp_path / "home"
        home.mkdir()
        shutil.copyfile(pair[0], home / "logs.db")
        result = run("merge", str(tmp_path / "m.db"), str(home), "--json")
        assert json.loads(result.stdout)["sources"][0]["source"] == str(home / "logs.db")
        assert run("stats", str(home), "--json").exit_code == 0
        empty = tmp_path / "empty"
        empty.mkdir()
        result = run("verify", str(empty))
        assert result.exit_code == 1
        assert result.stderr == (
            f"Error: {empty} is a directory with neither dag.db nor logs.db in it; "
            "pass the database file, or llm's home directory\n"
        )

    def test_sync_and_canonicalise(self, tmp_path, pair):
        result = run("sync", *map(str, pair), "--json")
        assert result.exit_code == 0
        assert set(json.loads(result.stdout)) == {"into_a", "into_b", "settle"}
        result = run("canonicalise", str(pair[0]))
        assert result.stdout.startswith(f"{pair[0]}: collapsed 0 duplicate message(s) in 0 group(s), 0 level(s) deep")
        assert run("canonicalize", str(pair[0]), "--json").exit_code == 0

    def test_canonicalise_refuses_the_llm_format(self, tmp_path):
        import apsw
        from dagsync.formats.llm import LLM

        path = tmp_path / "logs.db"
        conn = apsw.Connection(str(path))
        conn.execute(LLM.schema_sql)
        conn.close()
        result = run("canonicalise", str(path))
        assert result.exit_code == 1
        assert result.stderr == (
            f"Error: {path} is in the llm format; canonicalise works on the dag format only "
            "(llm-format messages are keyed by content already)\n"
        )


def lines_added(line: str) -> str:
    return line.split()[1]


COMMANDS = ("stats", "merge", "sync", "canonicalise", "verify", "gc", "forget", "pack", "unpack")


class TestConventions:
    @pytest.mark.parametrize("command", [None, *COMMANDS])
    def test_dash_h_is_help(self, command):
        args = [command] if command else []
        short, long = run(*args, "-h"), run(*args, "--help")
        assert (short.exit_code, long.exit_code) == (0, 0)
        assert short.stdout == long.stdout and short.stdout.startswith("Usage: ")

    @pytest.mark.parametrize(
        ("command", "usage"),
        [
            ("merge", "Usage: dagsync merge [OPTIONS] [TARGET] SOURCE..."),
            ("sync", "Usage: dagsync sync [OPTIONS] A B"),
            ("gc", "Usage: dagsync gc [OPTIONS] [DB]"),
            ("stats", "Usage: dagsync stats [OPTIONS] [DB]"),
            ("pack", "Usage: dagsync pack [OPTIONS] [DB]"),
        ],
    )
    def test_usage_lines_show_clean_metavars(self, command, usage):
        help_text = run(command, "--help").stdout
        assert help_text.splitlines()[0] == usage
        for ugly in ("{", "[[", "<list", "<bool>", "<path>"):
            assert ugly not in help_text

    def test_every_command_summary_fits_one_line(self):
        listing = run("--help").stdout.splitlines()
        rows = listing[listing.index("Commands:") + 1:]
        assert [row.split()[0] for row in rows] == list(COMMANDS[:3]) + ["push", "pull", "marks", "bundle", "canonicalise", "verify", "gc", "forget", "pack", "unpack"]
        for row in rows:
            assert not row.rstrip().endswith("...") and len(row) <= 80, row

    def test_options_show_their_values_metavar(self):
        assert "  --grace DURATION  " in run("gc", "--help").stdout
        assert "  --level N  " in run("pack", "--help").stdout

    def test_no_arguments_prints_help_and_exits_2(self):
        result = run()
        assert result.exit_code == 2 and "Commands:" in result.stderr + result.stdout

    def test_an_unknown_option_is_a_usage_error(self):
        result = run("verify", "--nope")
        assert result.exit_code == 2 and result.stderr.endswith("Error: No such option: --nope\n")


class TestSyncDryRun:
    def test_two_legs_that_write_nothing(self, tmp_path):
        from fixtures import family

        a, b = [r.path for r in family(tmp_path / "fam", seed=43, machines=2, conversations=20)]
        before = a.read_bytes(), b.read_bytes()
        result = run("sync", str(a), str(b), "--dry-run")
        assert result.exit_code == 0
        assert (a.read_bytes(), b.read_bytes()) == before
        firsts = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
        assert [line.split(":")[0] for line in firsts] == [str(a), str(b)]
        assert all(": would merge 1 source in " in line for line in firsts)
        assert result.stdout.endswith("  (a dry run: the forks the first merge would add to A are not in the second)\n")
        report = json.loads(run("sync", str(a), str(b), "--dry-run", "--json").stdout)
        assert report["settle"] is None and report["into_b"]["dry_run"] is True


def test_the_command_line_imports_no_click_of_its_own():
    """typer (0.26 and later) carries its own click, and a `pip install dagsync`
    without llm has no other: the command line must not need one."""
    code = "import sys, dagsync.cli; sys.exit('click' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
