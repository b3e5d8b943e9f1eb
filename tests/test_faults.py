"""Faults: an I/O error or a full disk at every Nth read, write or sync, and the
faults a person meets (a read-only file or directory, a lock held too long).

The sweep runs each writing command (merge, gc, pack, unpack, canonicalise)
on a small file through ``tests.faulty_vfs``, which fails the Nth operation of
one kind, for N spread over every operation of a clean run. After each fault:

* the command exits 1 with one line saying what happened and what to do
  (never "unexpected", never a traceback);
* the file passes ``dagsync verify`` (once a hot journal is rolled back, as
  the next llm or dagsync to open it does);
* the same command run again without faults ends with exactly the rows a
  clean run gives.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import apsw
import pytest
from typer.testing import CliRunner

from dagsync.blobs import pack
from dagsync.cli import app
from dagsync.faults import one_line
from dagsync.gc import gc
from dagsync.verify import verify
from fixtures import family, family_llm
from tests.faulty_vfs import Fault, installed
from tests.test_gc_crash import dump, orphan_dag, orphan_llm, roll_back

runner = CliRunner()

# How many N per kind of operation the sweep tries: the first, the last, and
# evenly spread between (a whole sweep of every N is SQLite's job; this keeps
# the suite within CI's time).
SAMPLES = 6
KINDS = ("write", "sync", "read")


@pytest.fixture(scope="module", params=["dag", "llm"])
def inputs(request, tmp_path_factory) -> dict[str, Path]:
    """Small files of one format: a source, a target, a file with garbage, a packed file."""
    fmt = request.param
    if fmt == "llm":
        pytest.importorskip("llm")
    make = family if fmt == "dag" else family_llm
    directory = tmp_path_factory.mktemp(f"faults-{fmt}")
    source = make(directory / "a", seed=21, machines=1, conversations=8)[0].path
    target = make(directory / "b", seed=22, machines=1, conversations=8)[0].path
    garbage = directory / "garbage.db"
    shutil.copyfile(target, garbage)
    (orphan_dag if fmt == "dag" else orphan_llm)(garbage)
    packed = directory / "packed.db"
    shutil.copyfile(source, packed)
    pack(packed, threshold=100)
    files = {"format": fmt, "source": source, "target": target, "garbage": garbage, "packed": packed}
    if fmt == "dag":
        # Duplicate messages, in a file without the unique index, for canonicalise to collapse.
        from tests.test_canonicalise import build

        twins = [(-1, 0), (-1, 0), (0, 1), (1, 1), (2, 2), (3, 2), (4, 0), (5, 0), (6, 1), (7, 1)]
        files["twins"] = directory / "twins.db"
        build(files["twins"], twins, list(range(len(twins))))
    return files


# Each command: the file it writes (copied fresh from an input) and its arguments.
COMMANDS: dict[str, tuple[str, Callable[[Path, dict], list[str]]]] = {
    "merge": ("target", lambda f, i: ["merge", str(f), str(i["source"])]),
    "gc": ("garbage", lambda f, i: ["gc", str(f), "--grace", "0s"]),
    "pack": ("source", lambda f, i: ["pack", str(f), "--threshold", "100"]),
    "unpack": ("packed", lambda f, i: ["unpack", str(f)]),
    "canonicalise": ("twins", lambda f, i: ["canonicalise", str(f)]),
}


def fresh(inputs: dict, command: str, directory: Path) -> tuple[Path, list[str]]:
    name, args = COMMANDS[command]
    path = directory / f"{command}.db"
    shutil.copyfile(inputs[name], path)
    return path, args(path, inputs)


def spread(count: int) -> list[int]:
    if count <= SAMPLES:
        return list(range(1, count + 1))
    return sorted({1 + round(k * (count - 1) / (SAMPLES - 1)) for k in range(SAMPLES)})


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_fault_at_any_operation_leaves_a_file_that_verifies_and_a_rerun_completes(inputs, tmp_path, command):
    if command == "canonicalise" and inputs["format"] != "dag":
        pytest.skip("canonicalise is for the dag format")
    (tmp_path / "clean").mkdir()
    clean, args = fresh(inputs, command, tmp_path / "clean")
    with installed() as counting:
        result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    expected = dump(clean)
    # A fault may leave what the input already had (canonicalise's twins), nothing new.
    had = {p.check for p in verify(inputs[COMMANDS[command][0]]).problems}
    tried = 0
    for kind in KINDS:
        for nth in spread(counting.counts[kind]):
            error = "full" if kind == "write" and nth % 2 else "ioerr"
            directory = tmp_path / f"{kind}-{nth}"
            directory.mkdir()
            path, args = fresh(inputs, command, directory)
            with installed(Fault(kind, nth, error)) as faulty:
                result = runner.invoke(app, args)
            case = f"{command} with {error} on {kind} #{nth}: exit {result.exit_code}, {result.stderr!r}"
            if faulty.fired:
                tried += 1
                assert result.exit_code == 1, case
                assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, case
                assert "unexpected" not in result.stderr and "Traceback" not in result.stderr, case
            else:
                assert result.exit_code == 0, case
            roll_back(path)
            assert [p for p in verify(path).problems if p.check not in had] == [], case
            again = runner.invoke(app, args)
            assert again.exit_code == 0, f"{case}; the re-run: {again.stderr!r}"
            assert dump(path) == expected, case
    assert tried >= 2 * SAMPLES, "too few faults fired: the sweep proved little"


# -- the faults a person meets ---------------------------------------------------------------


def read_only(path: Path) -> Callable[[], None]:
    """Make ``path`` (a file or a directory) read-only even to root, as a read-only
    mount is: ``chattr +i`` when running as root, else ``chmod``. Returns the undo."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("running as root without chattr +i: nothing here is read-only to root")
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    mode = path.stat().st_mode
    path.chmod(stat.S_IRUSR | stat.S_IXUSR if path.is_dir() else stat.S_IRUSR)
    return lambda: path.chmod(mode)


@pytest.mark.parametrize("what", ["file", "directory"])
@pytest.mark.parametrize("command", ["merge", "gc", "pack"])
def test_a_read_only_file_or_directory_is_named_and_left_as_it_was(inputs, tmp_path, what, command):
    directory = tmp_path / "ro"
    directory.mkdir()
    path, args = fresh(inputs, command, directory)
    before = path.read_bytes()
    undo = read_only(path if what == "file" else directory)
    try:
        result = runner.invoke(app, args)
    finally:
        undo()
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"Error: {path}: cannot be written ("), result.stderr
    assert result.stderr.endswith(
        "): the file or its directory is read-only, and SQLite writes a journal beside the file; "
        "nothing was written - make both writable and run the command again\n"
    )
    assert path.read_bytes() == before
    assert sorted(p.name for p in directory.iterdir()) == [path.name]


# A child that takes an EXCLUSIVE lock on a file and holds it until killed.
HOLD = r"""
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(600)
"""


def locked_message(path: Path) -> str:
    return (
        f"Error: another program is writing to {path}; try again when it has finished (it held its lock "
        f"longer than dagsync waits; the file is as it was after its last commit; `fuser {path}` shows who "
        "has it open)\n"
    )


@pytest.mark.parametrize("command", ["gc", "merge into", "merge from", "stats", "verify"])
def test_a_lock_held_longer_than_dagsync_waits_is_named(inputs, tmp_path, command, monkeypatch):
    """One line, exit 1, naming the file that is locked, whichever it is."""
    from dagsync import checks, db

    # A reader's patience, shortened for the test: the sources' (db) and their page checks' (checks).
    monkeypatch.setattr(db, "READ_BUSY_TIMEOUT_MS", 1000)
    monkeypatch.setattr(checks, "READ_BUSY_TIMEOUT_MS", 1000)
    target, args = fresh(inputs, "gc" if command in ("gc", "stats", "verify") else "merge", tmp_path)
    source = tmp_path / "source.db"
    shutil.copyfile(inputs["source"], source)
    locked = source if command == "merge from" else target
    if command == "merge from":
        args = ["merge", str(target), str(source)]
    elif command in ("stats", "verify"):
        args = [command, str(target)]
    before = target.read_bytes(), source.read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(locked)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = runner.invoke(app, args)
    finally:
        holder.kill()
        holder.wait()
    assert (result.exit_code, result.stderr) == (1, locked_message(locked))
    roll_back(locked)
    assert (target.read_bytes(), source.read_bytes()) == before
    assert verify(target).problems == ()


def test_a_wait_for_another_programs_lock_is_said_on_a_terminal(inputs, tmp_path, monkeypatch):
    """The library says it through the ``dagsync`` logger; the command line
    prints it on a terminal only, naming the file, and the command then goes on."""
    import logging

    from dagsync import transactions

    target, _ = fresh(inputs, "gc", tmp_path)
    said: list[str] = []
    monkeypatch.setattr(transactions, "NOTICE_SECONDS", 0.2)

    class Listen(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    listen = Listen()
    logging.getLogger("dagsync").addHandler(listen)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        threading.Timer(1.0, holder.kill).start()  # let go while gc waits
        report = gc(target, grace="0s")
    finally:
        logging.getLogger("dagsync").removeHandler(listen)
        holder.kill()
        holder.wait()
    assert said and set(said) == {f"waiting for another program to finish writing {target.resolve()} ..."}
    assert report.deleted > 0
    assert verify(target).problems == ()


def damaged_page(path: Path) -> None:
    """Point the first cell of a leaf page of ``messages`` out of range: quick_check's
    message about it is several lines long."""
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    (page,) = next(iter(conn.execute("SELECT pageno FROM dbstat WHERE name = 'messages' AND pagetype = 'leaf' ORDER BY pageno LIMIT 1")))
    conn.close()
    data = bytearray(path.read_bytes())
    base = (page - 1) * 4096
    data[base + 8 : base + 12] = b"\x00\x00\x00\x09"
    path.write_bytes(bytes(data))


def per_table_damage(path: Path) -> str:
    """What ``PRAGMA quick_check(TABLE)`` says first, table by table in name order, as a
    command checks a file before it writes."""
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)  # SQLite's words differ by version: dagsync's
    for (table,) in list(conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name")):
        (said,) = next(iter(conn.execute(f"PRAGMA quick_check('{table}')")))
        if said != "ok":
            break
    conn.close()
    assert said != "ok"
    return said


def test_sqlite_messages_of_several_lines_are_folded_into_one(inputs, tmp_path):
    assert one_line("*** in database main ***\nOn tree page 5 cell 0: Offset 0 out of range") == (
        "*** in database main *** On tree page 5 cell 0: Offset 0 out of range"
    )
    source = tmp_path / "damaged.db"
    shutil.copyfile(inputs["source"], source)
    damaged_page(source)
    conn = apsw.Connection(str(source), flags=apsw.SQLITE_OPEN_READONLY)
    (said,) = next(iter(conn.execute("PRAGMA quick_check")))
    conn.close()
    assert "\n" in said  # SQLite's own message: several lines
    for args in (["stats", str(source)], ["merge", str(tmp_path / "t.db"), str(source)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, result.stderr
        assert result.stderr == (
            f"Error: {source} is damaged: PRAGMA quick_check says: {one_line(said)}; restore it from a backup, "
            f"or recover a copy with `sqlite3 {source} .recover`\n"
        )


@pytest.mark.parametrize("command", ["gc", "pack", "unpack", "canonicalise"])
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_no_command_writes_into_a_damaged_file(inputs, tmp_path, command, dry_run):
    if command == "canonicalise" and inputs["format"] != "dag":
        pytest.skip("canonicalise is for the dag format")
    path, args = fresh(inputs, command, tmp_path)
    damaged_page(path)
    said = per_table_damage(path)
    before = path.read_bytes()
    result = runner.invoke(app, [*args, *(["--dry-run"] if dry_run else [])])
    assert (result.exit_code, result.stderr) == (1, (
        f"Error: {path} is damaged: PRAGMA quick_check says: {one_line(said)}; nothing was written - "
        f"restore it from a backup, or recover a copy with `sqlite3 {path} .recover`\n"
    ))  # fmt: skip
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# A child that writes to a file in one transaction held for a while, as llm
# logging a long response would, then commits.
WRITE_FOR_A_WHILE = r"""
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
conn.execute("CREATE TABLE IF NOT EXISTS scratch (x)")
print("writing", flush=True)
time.sleep(1.5)
conn.execute("COMMIT")
"""


def test_a_source_being_written_is_waited_for(inputs, tmp_path):
    source = tmp_path / "source.db"
    shutil.copyfile(inputs["source"], source)
    writer = subprocess.Popen([sys.executable, "-c", WRITE_FOR_A_WHILE, str(source)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        result = runner.invoke(app, ["merge", str(tmp_path / "target.db"), str(source)])
    finally:
        writer.wait(timeout=30)
    assert result.exit_code == 0, result.stderr
    assert writer.returncode == 0
