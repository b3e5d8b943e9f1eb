"""TEXT that is not UTF-8: named by table, column and row, never a crash.

SQLite keeps any bytes as TEXT; Python cannot read them as a string, and
neither can llm. Before ``encoding.py`` the first read of such a value ended
a command with "unexpected UnicodeDecodeError" (merge, gc, forget, verify),
or, where the failed statement was cleaned up after, with an unrelated
LockedError. Each case damages one value in the middle of a table.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import apsw
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dagsync import encoding
from dagsync.cli import app
from dagsync.verify import Problem, verify
from conftest import source_and_target

runner = CliRunner()


@pytest.fixture(scope="module", params=["dag", "llm"])
def files(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(format, a source, an unrelated existing target) of that format."""
    return source_and_target(request.param, tmp_path_factory)


def damage(path: Path, table: str, column: str) -> tuple[int, int]:
    """Append byte 0xff to the middle text value of ``table.column``: (its rowid, the byte's offset)."""
    with sqlite3.connect(path) as conn:
        text = f'typeof("{column}") = \'text\' AND length("{column}") > 0'
        rowid, size = conn.execute(
            f'SELECT rowid, length(CAST("{column}" AS BLOB)) FROM "{table}" WHERE {text} ORDER BY rowid '
            f'LIMIT 1 OFFSET (SELECT count(*) / 2 FROM "{table}" WHERE {text})'
        ).fetchone()
        conn.execute(f'UPDATE "{table}" SET "{column}" = CAST(CAST("{column}" AS BLOB) || X\'FF\' AS TEXT) WHERE rowid = ?', (rowid,))
    conn.close()
    return rowid, size


def damaged_copy(files, tmp_path: Path, table: str, column: str) -> tuple[Path, str]:
    """A copy of the source with one value of ``table.column`` damaged, and what names it."""
    path, rowid, offset = damaged_at(files, tmp_path, table, column)
    return path, f"{table}.{column} of row {rowid} is not UTF-8 text (byte 0xff at offset {offset}: invalid start byte)"


def damaged_at(files, tmp_path: Path, table: str, column: str) -> tuple[Path, int, int]:
    fmt, clean, _ = files
    source = tmp_path / "source.db"
    shutil.copyfile(clean, source)
    return source, *damage(source, table, column)


def named(path: Path, found: str, written: str = "nothing was written") -> str:
    return (
        f"Error: {path} is damaged: {found}; {written} - run `dagsync verify {path}` to list every such "
        "value, and restore the file from a backup\n"
    )


# Columns whose first read used to crash a merge: a key the marks read, a
# message's parent, a reference checked for dangling, a fragment's content.
MERGE_CASES = {
    "dag": [("messages", "parent_id"), ("schemas", "id"), ("prompt_attachments", "response_id"), ("fragments", "content")],
    "llm": [("parts", "type"), ("schemas", "id"), ("turns", "thread_id"), ("fragments", "content")],
}


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("into", ["new-target", "existing-target"])
def test_merge_names_the_value_and_writes_nothing(files, tmp_path, case, into):
    fmt, _, unrelated = files
    source, found = damaged_copy(files, tmp_path, *MERGE_CASES[fmt][case])
    target = tmp_path / "target.db"
    if into == "existing-target":
        shutil.copyfile(unrelated, target)
    before = {p: p.read_bytes() for p in (source, target) if p.exists()}
    result = runner.invoke(app, ["merge", str(target), str(source)])
    assert (result.exit_code, result.stderr) == (1, named(source, found))
    assert {p: p.read_bytes() for p in (source, target) if p.exists()} == before
    assert target.exists() == (into == "existing-target")


# A column every format has that the commands read into Python: gc reads the
# migrations' names; forget, the conversations' names and ids it selects.
COMMAND_CASES = {
    "gc": {"dag": ("_llm_migrations", "name"), "llm": ("_llm_migrations", "name")},
    "forget": {"dag": ("conversations", "name"), "llm": ("threads", "name")},
}


@pytest.mark.parametrize("command", list(COMMAND_CASES))
def test_gc_and_forget_name_the_value_and_write_nothing(files, tmp_path, command):
    fmt = files[0]
    path, found = damaged_copy(files, tmp_path, *COMMAND_CASES[command][fmt])
    before = path.read_bytes()
    args = [command, str(path)] + (["--older-than", "1d", "--yes"] if command == "forget" else [])
    result = runner.invoke(app, args)
    assert (result.exit_code, result.stderr) == (1, named(path, found))
    assert path.read_bytes() == before


VERIFY_CASES = {
    # A key (verify's key check used to crash on it), a message's parent (its
    # dangling-parent check), and a plain column no check read at all.
    "dag": [("fragments", "hash"), ("messages", "parent_id"), ("tool_calls", "name")],
    "llm": [("fragments", "hash"), ("messages", "parent_hash"), ("tool_instances", "plugin")],
}


@pytest.mark.parametrize("case", range(3))
def test_verify_lists_the_value_and_goes_on(files, tmp_path, case):
    fmt = files[0]
    table, column = VERIFY_CASES[fmt][case]
    path, rowid, offset = damaged_at(files, tmp_path, table, column)
    before = path.read_bytes()
    report = verify(path)
    text = [p for p in report.problems if p.check == "text"]
    assert text == [Problem("text", table, f"rowid {rowid}", f"{column} is not UTF-8 text (byte 0xff at offset {offset}: invalid start byte)")]
    # Every other check ran to its end, or said it could not and why.
    assert set(report.counts) >= {"integrity", "text", "keys", "content", "blobs"}
    for problem in report.problems:
        if problem.what.startswith("this check could not finish"):
            assert problem.what == "this check could not finish: it read text that is not UTF-8 (the text check names it)"
    result = runner.invoke(app, ["verify", str(path)])
    assert result.exit_code == 1 and f"{table} rowid {rowid}: {column} is not UTF-8 text" in result.stdout
    assert path.read_bytes() == before


def test_a_healthy_file_has_no_text_problem(files):
    assert verify(files[1]).counts["text"] == 0


def test_sync_says_what_the_first_merge_wrote(files, tmp_path):
    """Text no key covers is copied as it is (see docs/verify.md): sync finds it
    in the second merge and says that the first wrote A."""
    fmt, _, unrelated = files
    b, found = damaged_copy(files, tmp_path, *{"dag": ("_llm_migrations", "name"), "llm": ("tool_instances", "plugin")}[fmt])
    a = tmp_path / "a.db"
    shutil.copyfile(unrelated, a)
    before = b.read_bytes()
    result = runner.invoke(app, ["sync", str(a), str(b)])
    assert (result.exit_code, result.stderr) == (1, named(b, found, f"{a} was merged from {b} before it was found, and {b} was not written"))
    assert b.read_bytes() == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=12), min_size=1, max_size=8))
def test_law_the_values_found_are_exactly_those_python_cannot_read(values):
    conn = apsw.Connection(":memory:")
    conn.execute("CREATE TABLE t (a, b)")
    for value in values:
        conn.execute("INSERT INTO t VALUES (CAST(? AS TEXT), ?)", (value, value))  # b stays a BLOB: never text
    expected = []
    for rowid, value in enumerate(values, start=1):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            expected.append(rowid)
    assert [(f.table, f.column, f.rowid) for f in encoding.values(conn)] == [("t", "a", r) for r in expected]


def test_names_with_quotes_and_tables_without_rowid_are_searched():
    conn = apsw.Connection(":memory:")
    conn.execute('CREATE TABLE "we""ird" ("a""b", c)')
    conn.execute("INSERT INTO \"we\"\"ird\" VALUES (CAST(X'61FF' AS TEXT), 1)")
    conn.execute("CREATE TABLE w (k PRIMARY KEY, v) WITHOUT ROWID")
    conn.execute("INSERT INTO w VALUES (1, CAST(X'C0' AS TEXT))")
    assert [str(f) for f in encoding.values(conn)] == [
        'we"ird.a"b of row 1 is not UTF-8 text (byte 0xff at offset 1: invalid start byte)',
        "w.v of a row without a rowid is not UTF-8 text (byte 0xc0 at offset 0: invalid start byte)",
    ]
