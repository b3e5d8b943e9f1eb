"""Defaults that protect llm's own database, and reports that say what happened to a file's size."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dagsync.cli import app
from dagsync.unpack import unpack
from dagsync.verify import verify

pytest.importorskip("llm")

runner = CliRunner()


def run(*args: str, home: Path):
    return runner.invoke(app, list(args), env={"LLM_USER_PATH": str(home)}, catch_exceptions=False)


def llm(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLM_USER_PATH": str(home)}
    return subprocess.run([sys.executable, "-m", "llm", *args], env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def llm_home(tmp_path_factory) -> Path:
    """An llm home whose logs.db llm itself wrote, with one payload long enough to pack."""
    home = tmp_path_factory.mktemp("home")
    assert llm(home, "-m", "echo", "hello " * 100).returncode == 0
    assert llm(home, "-m", "echo", "a second, short prompt").returncode == 0
    return home


@pytest.fixture
def home(llm_home, tmp_path) -> Path:
    copy = tmp_path / "home"
    shutil.copytree(llm_home, copy)
    return copy


def refusal(path: Path) -> str:
    return (
        f"Error: {path} is llm's own database, and llm cannot read a packed file until `dagsync unpack`; "
        "pack a copy with `--output FILE`, or pass --force to pack it in place\n"
    )


class TestPackLeavesLlmsOwnDatabaseAlone:
    @pytest.mark.parametrize("how", ["default", "by path", "by home directory"])
    def test_refused_however_it_is_named(self, home, how):
        db = home / "logs.db"
        before = db.read_bytes()
        args = {"default": [], "by path": [str(db)], "by home directory": [str(home)]}[how]
        result = run("pack", *args, home=home)
        assert (result.exit_code, result.stdout, result.stderr) == (1, "", refusal(db))
        assert db.read_bytes() == before
        assert llm(home, "logs", "-n", "1").returncode == 0

    def test_a_dry_run_is_not_refused(self, home):
        result = run("pack", "--dry-run", home=home)
        assert result.exit_code == 0 and result.stdout.startswith(f"{home / 'logs.db'}: would pack ")

    def test_force_packs_it_in_place(self, home):
        result = run("pack", "--force", "--threshold", "100", "--json", home=home)
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["columns"][0]["packed"] >= 1
        unpack(home / "logs.db")
        assert verify(home / "logs.db").ok

    def test_output_packs_a_copy_and_leaves_the_database_as_it_was(self, home, tmp_path):
        db, archive = home / "logs.db", tmp_path / "archive.db"
        before = db.read_bytes()
        listed = llm(home, "logs", "list", "--json", "-n", "0").stdout
        result = run("pack", "--output", str(archive), "--threshold", "100", home=home)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.startswith(f"{archive}: packed ") and "packed 0 payload" not in result.stdout
        assert db.read_bytes() == before
        assert llm(home, "logs", "list", "--json", "-n", "0").stdout == listed
        assert stat.S_IMODE(archive.stat().st_mode) == 0o600
        assert verify(archive).ok
        unpack(archive)
        other = tmp_path / "other"
        other.mkdir()
        shutil.copyfile(archive, other / "logs.db")
        assert llm(other, "logs", "list", "--json", "-n", "0").stdout == listed

    def test_the_text_report_lists_only_columns_that_hold_payloads(self, home, tmp_path):
        archive = tmp_path / "archive.db"
        report = json.loads(run("pack", "-o", str(archive), "--dry-run", "--json", home=home).stdout)
        empty = [c for c in report["columns"] if not (c["packed"] or c["inline"])]
        assert empty and len(empty) < len(report["columns"])
        text = run("pack", "-o", str(archive), "--dry-run", home=home).stdout.splitlines()
        listed = [line.split()[0] for line in text if line.startswith("    ") and not line.startswith("    (")]
        assert listed == [f"{c['table']}.{c['column']}" for c in report["columns"] if c not in empty]
        assert f"    ({len(empty)} column(s) with no payloads not shown; --json lists every one)" in text

    def test_output_never_overwrites(self, home, tmp_path):
        archive = tmp_path / "archive.db"
        archive.write_bytes(b"keep me")
        result = run("pack", "-o", str(archive), home=home)
        assert (result.exit_code, result.stderr) == (
            1, f"Error: {archive} already exists; give a new file to copy into, or remove it first\n"
        )
        assert archive.read_bytes() == b"keep me"


class TestAFileThatGrowsSaysWhy:
    def test_pack_of_a_small_file(self, home, tmp_path):
        archive = tmp_path / "archive.db"
        result = run("pack", "-o", str(archive), "--json", home=home)
        report = json.loads(result.stdout)
        assert report["file_bytes_after"] > report["file_bytes_before"]
        growth = report["file_bytes_after"] - report["file_bytes_before"]
        packed = sum(c["packed"] for c in report["columns"])
        assert report["grew"] == (
            f"the file grew by {growth:,} bytes: the blob store's tables and index take pages of their own, "
            f"more than packing {packed:,} payload(s) gave back; --vacuum returns the pages the packed rows freed "
            "(packing pays off on files with long or repeated payloads)"
        )
        text = run("unpack", str(archive), home=home)
        assert text.exit_code == 0

    def test_the_text_report_carries_the_reason(self, home, tmp_path):
        result = run("pack", "-o", str(tmp_path / "a.db"), home=home)
        assert result.stdout.splitlines()[-1].startswith("  the file grew by ")

    def test_gc_that_deletes_nothing_writes_nothing_and_vacuum_does_not_grow_it(self, home):
        db = home / "logs.db"
        before = db.read_bytes()
        assert run("gc", "--grace", "0s", home=home).exit_code == 0
        assert db.read_bytes() == before  # no bookkeeping tables for nothing
        result = run("gc", "--grace", "0s", "--vacuum", "--json", home=home)
        report = json.loads(result.stdout)["vacuum"]
        assert report["bytes_after"] <= len(before) or report["grew"].startswith("the file grew by ")
        assert llm(home, "logs", "-n", "1").returncode == 0


class TestStatsSpeaksTheFormatsWords:
    def test_an_llm_file_has_threads_and_turns_and_no_empty_tables(self, home):
        result = run("stats", home=home)
        assert result.exit_code == 0
        lines = result.stdout.splitlines()
        assert lines[0] == f"{home / 'logs.db'}  (llm format, {(home / 'logs.db').stat().st_size / 1024:.1f} KiB)"
        assert [line.split()[:2] for line in lines[1:3]] == [["threads", "2"], ["turns", "2"]]
        assert "conversations" not in result.stdout and "calls" not in result.stdout
        shown = lines[lines.index(next(line for line in lines if line.startswith("  rows per table"))) + 1:]
        assert shown and all(int(line.split()[-1].replace(",", "")) > 0 for line in shown)
        assert {line.split()[0] for line in shown} >= {"messages", "parts", "threads", "turns"}
        report = json.loads(run("stats", "--json", home=home).stdout)
        assert (report["conversation_table"], report["call_table"]) == ("threads", "turns")
        assert report["tables"]["conversations"] == 0 and report["tables"]["responses"] == 0  # every table in JSON
        empty = sum(1 for rows in report["tables"].values() if not rows)
        assert f"  rows per table ({empty} empty not shown; --json lists every table):" in lines
