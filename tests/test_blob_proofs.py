"""Every blob is proven by its key when read: unpack, merge and verify never pass on a
damaged one, a decompression bomb costs nothing, and a refusal writes nothing.

A tamper test per way a blob can be wrong, in both formats: the exact one-line
message, exit status 1, and every file byte for byte as it was.
"""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from typer.testing import CliRunner

from dagsync.blobs import pack
from dagsync.cli import app
from dagsync.verify import verify
from fixtures import family, family_llm

runner = CliRunner()
BOMB_SIZE = 3 * 2**30  # what the bomb's frame declares; it is about 98 KB


@pytest.fixture(autouse=True)
def short_transactions_of_a_few_rows(monkeypatch):
    """Every chunk its own transaction, committed, as beside a live llm: a refusal
    that came only once some chunks were written would leave them in the file.
    (One long transaction would roll them back and hide that.)"""
    import contextlib

    import dagsync.transactions
    import dagsync.writer

    monkeypatch.setattr(dagsync.transactions, "long_transactions", lambda conn: contextlib.nullcontext())
    for name in ("FIRST_CHUNK", "MAX_READ_CHUNK", "MAX_WRITE_CHUNK", "ALONE_MAX_WRITE_CHUNK"):
        monkeypatch.setattr(dagsync.writer, name, 20)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """One zstd frame that declares 3 GiB (of zeros)."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=BOMB_SIZE, closefd=False) as writer:
        chunk = b"\0" * (1 << 22)
        for _ in range(BOMB_SIZE // len(chunk)):
            writer.write(chunk)
    return out.getvalue()


@pytest.fixture(scope="module", params=["dag", "llm"])
def packed_file(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(f"packed-{request.param}")
    if request.param == "llm":
        pytest.importorskip("llm")
        path = family_llm(directory / "fam", seed=8, machines=1, conversations=30)[0].path
    else:
        path = family(directory / "fam", seed=8, machines=1, conversations=30)[0].path
    pack(path, threshold=100)
    return path


def copy(path: Path, directory: Path, name: str) -> Path:
    out = directory / name
    shutil.copyfile(path, out)
    return out


def a_blob(path: Path, nth: int = 0) -> tuple[str, int]:
    """(hash, size) of a blob that one packed value refers to, one of the last rows
    (so that a merge or unpack that refused late would have written rows before it)."""
    with sqlite3.connect(path) as conn:
        table, column = ("message_parts", "content") if "message_parts" in _tables(conn) else ("parts", "text")
        refs = f"SELECT {_ref_hash(column, 'text')} AS h, rowid AS r FROM {table} WHERE typeof({column}) = 'blob'"
        row = conn.execute(
            f"SELECT b.hash, b.size FROM ({refs}) x JOIN blobs b ON b.hash = x.h WHERE b.dict IS NULL "
            f"GROUP BY x.h HAVING count(*) = 1 ORDER BY max(x.r) DESC LIMIT 1 OFFSET ?",
            (nth,),
        ).fetchone()
    conn.close()
    return row


def _ref_hash(value: str, holds: str) -> str:
    """SQL for the hash a reference in a column holding ``holds`` names (written here
    from docs/blobs.md, not from dagsync): in a column of text a BLOB, ``dagsync:``
    and the 32 bytes of the hash; in a column of bytes TEXT, ``dagsync:`` and hex."""
    return f"lower(hex(substr({value}, 9)))" if holds == "text" else f"substr({value}, 9)"


def _quoted(name: str) -> str:
    return f'"{name}"'


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}


def tamper(path: Path, sql: str, params: tuple = ()) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(sql, params)
    conn.close()


def refusal(path: Path, key: str, what: str) -> str:
    return (
        f"Error: {path}: blob {key} {what}; its blob store is damaged and nothing was written - "
        f"run `dagsync verify {path}` to see all of it, and restore the file from a backup\n"
    )


# Each case damages one blob and says how its proof fails.
def bad_hash(path: Path) -> tuple[str, str]:
    key, _ = a_blob(path)
    other, size = a_blob(path, 1)
    with sqlite3.connect(path) as conn:
        data = conn.execute("SELECT data FROM blobs WHERE hash = ?", (other,)).fetchone()[0]
        conn.execute("UPDATE blobs SET data = ?, size = ? WHERE hash = ?", (data, size, key))
    conn.close()
    return key, f"holds a payload that does not hash to its key (it hashes to {other})"


def bad_size(path: Path) -> tuple[str, str]:
    key, size = a_blob(path)
    tamper(path, "UPDATE blobs SET size = size + 1 WHERE hash = ?", (key,))
    return key, f"declares {size} bytes, not its size {size + 1}"


def garbage(path: Path) -> tuple[str, str]:
    key, _ = a_blob(path)
    tamper(path, "UPDATE blobs SET data = x'00112233' WHERE hash = ?", (key,))
    return key, "does not decompress (error when determining content size)"


def missing(path: Path) -> tuple[str, str]:
    key, _ = a_blob(path)
    tamper(path, "DELETE FROM blobs WHERE hash = ?", (key,))
    return key, "is missing"


CASES = {"bad-hash": bad_hash, "bad-size": bad_size, "garbage": garbage, "missing": missing}


@pytest.mark.parametrize("case", list(CASES))
def test_unpack_refuses_a_damaged_blob_and_writes_nothing(packed_file, tmp_path, case):
    path = copy(packed_file, tmp_path, "packed.db")
    key, what = CASES[case](path)
    before = path.read_bytes()
    result = runner.invoke(app, ["unpack", str(path)])
    assert (result.exit_code, result.stderr) == (1, refusal(path, key, what))
    assert path.read_bytes() == before


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("target_exists", [False, True], ids=["new-target", "existing-target"])
def test_merge_refuses_a_source_with_a_damaged_blob_and_writes_nothing(packed_file, tmp_path, case, target_exists):
    source = copy(packed_file, tmp_path, "source.db")
    key, what = CASES[case](source)
    target = tmp_path / "target.db"
    if target_exists:
        # An older copy of the same history: the damaged blob's rows are among the new ones.
        fam = (family_llm if "hash" in _columns(source) else family)(tmp_path / "other", seed=9, machines=1, conversations=5)
        shutil.copyfile(fam[0].path, target)
    before_source, before_target = source.read_bytes(), target.read_bytes() if target_exists else None
    result = runner.invoke(app, ["merge", str(target), str(source)])
    expected = refusal(source, key, what)
    assert (result.exit_code, result.stderr) == (1, expected)
    assert source.read_bytes() == before_source
    if target_exists:
        assert target.read_bytes() == before_target
    else:
        assert not target.exists()


# Columns packed since pack packed every payload column: a blob only one of them refers to.
NEWLY_PACKED = {
    "dag": [("responses", "response"), ("responses", "system"), ("tool_results", "output")],
    "llm": [("turns", "response_json"), ("turn_search", "prompt"), ("turn_search", "response")],  # llm 0.36 leaves the legacy tables empty
}


def a_blob_only(path: Path, table: str, column: str) -> tuple[str, int]:
    """(hash, size) of a blob that ``table.column`` alone refers to, in one of its last rows."""
    from dagsync.formats.dag import DAG
    from dagsync.formats.llm import LLM

    fmt = LLM if "hash" in _columns(path) else DAG
    mine = _ref_hash(f"t.{_quoted(column)}", "text")
    with sqlite3.connect(path) as conn:
        present = _tables(conn)
        others = " UNION ALL ".join(
            f'SELECT {_ref_hash(_quoted(c.column), c.holds)} FROM "{c.table}" WHERE typeof("{c.column}") = '
            f"'{'blob' if c.holds == 'text' else 'text'}'"
            for c in fmt.packed if c.table in present and (c.table, c.column) != (table, column)
        )  # fmt: skip
        row = conn.execute(
            f'SELECT b.hash, b.size FROM "{table}" t JOIN blobs b ON b.hash = {mine} '
            f"WHERE typeof(t.\"{column}\") = 'blob' AND b.dict IS NULL AND b.hash NOT IN ({others}) "
            f"GROUP BY b.hash HAVING count(*) = 1 ORDER BY max(t.rowid) DESC LIMIT 1"
        ).fetchone()
    conn.close()
    assert row is not None, f"no blob that {table}.{column} alone refers to: the test would prove nothing"
    return row


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_damaged_blob_of_a_newly_packed_column_is_refused_by_unpack_and_merge_and_named_by_verify(packed_file, tmp_path, which):
    fmt = "llm" if "hash" in _columns(packed_file) else "dag"
    table, column = NEWLY_PACKED[fmt][which]
    path = copy(packed_file, tmp_path, "packed.db")
    # A payload of its own (most of these repeat a message's text: one blob), packed.
    tamper(path, f'UPDATE "{table}" SET "{column}" = ? WHERE rowid = (SELECT max(rowid) FROM "{table}")', (f"only {table}.{column} holds this " * 10,))
    pack(path)
    key, size = a_blob_only(path, table, column)
    tamper(path, "UPDATE blobs SET size = size + 1 WHERE hash = ?", (key,))
    what = f"declares {size} bytes, not its size {size + 1}"
    before = path.read_bytes()
    result = runner.invoke(app, ["unpack", str(path)])
    assert (result.exit_code, result.stderr) == (1, refusal(path, key, what))
    target = tmp_path / "target.db"
    result = runner.invoke(app, ["merge", str(target), str(path)])
    assert (result.exit_code, result.stderr) == (1, refusal(path, key, what))
    assert path.read_bytes() == before and not target.exists()
    assert any(p.check == "blobs" and p.key == key and p.what == what for p in verify(path).problems)


def _columns(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {row[1] for row in conn.execute("PRAGMA table_info(messages)")}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_names_each_damaged_blob(packed_file, tmp_path, case):
    path = copy(packed_file, tmp_path, "packed.db")
    key, what = CASES[case](path)
    problems = verify(path).problems
    if case == "missing":  # named by the value that refers to it
        assert any(p.check == "blobs" and p.what.endswith(f"refers to blob {key}, which is missing") for p in problems)
    else:
        assert any(p.check == "blobs" and p.key == key and p.what == what for p in problems)


# -- a decompression bomb: refused before anything is decompressed ----------------------------

# A child process, so that its peak memory is its own: runs one command on the
# file and prints its exit status, its stderr, and its peak RSS in MB.
MEASURED = r"""
import contextlib, io, json, sys
from typer.testing import CliRunner
import dagsync.transactions, dagsync.writer
from dagsync.cli import app
dagsync.transactions.long_transactions = lambda conn: contextlib.nullcontext()
dagsync.writer.FIRST_CHUNK = dagsync.writer.MAX_READ_CHUNK = dagsync.writer.MAX_WRITE_CHUNK = 20
dagsync.writer.ALONE_MAX_WRITE_CHUNK = 20
result = CliRunner().invoke(app, sys.argv[1:])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
print(json.dumps([result.exit_code, result.stderr, hwm]))
"""


def measured(*args: str) -> tuple[int, str, float]:
    out = subprocess.run([sys.executable, "-c", MEASURED, *args], capture_output=True, text=True, check=True).stdout
    code, stderr, hwm = json.loads(out)
    return code, stderr, hwm


@pytest.mark.parametrize("claims", ["its-own-size", "the-bomb-size"])
def test_a_decompression_bomb_is_refused_unread_in_bounded_memory(packed_file, tmp_path, bomb, claims):
    path = copy(packed_file, tmp_path, "packed.db")
    key, size = a_blob(path)
    if claims == "its-own-size":
        tamper(path, "UPDATE blobs SET data = ? WHERE hash = ?", (bomb, key))
        what = f"declares {BOMB_SIZE} bytes, not its size {size}"
    else:
        tamper(path, "UPDATE blobs SET data = ?, size = ? WHERE hash = ?", (bomb, BOMB_SIZE, key))
        what = f"is {BOMB_SIZE} bytes, longer than any value SQLite holds (1000000000)"
    before = path.read_bytes()
    # unpack
    code, stderr, hwm = measured("unpack", str(path))
    assert (code, stderr) == (1, refusal(path, key, what))
    assert hwm < 400 and path.read_bytes() == before
    # merge, into a new target
    target = tmp_path / "target.db"
    code, stderr, hwm = measured("merge", str(target), str(path))
    assert (code, stderr) == (1, refusal(path, key, what))
    assert hwm < 400 and not target.exists() and path.read_bytes() == before
    # verify names it, and goes on with every other check
    code, stderr, hwm = measured("verify", str(path), "--json")
    assert code == 1 and hwm < 400


def test_verify_reports_a_bomb_and_every_other_check(packed_file, tmp_path, bomb):
    path = copy(packed_file, tmp_path, "packed.db")
    key, size = a_blob(path)
    tamper(path, "UPDATE blobs SET data = ? WHERE hash = ?", (bomb, key))
    report = verify(path)
    assert any(p.check == "blobs" and p.key == key and p.what == f"declares {BOMB_SIZE} bytes, not its size {size}" for p in report.problems)
    assert set(report.counts) == {"integrity", "text", "foreign keys", "dangling parents", "cycles", "duplicate identities", "content", "keys", "bookkeeping", "blobs"}
    # The messages whose part it was cannot be read back: named too, by the content check.
    assert report.counts["content"] >= 1


# -- a packed file that lost its blob store ----------------------------------------------------


def lose_the_store(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE blobs")
        conn.execute("DROP TABLE blob_dicts")
    conn.close()


def test_unpack_and_merge_refuse_a_packed_file_without_its_store(packed_file, tmp_path):
    path = copy(packed_file, tmp_path, "packed.db")
    lose_the_store(path)
    before = path.read_bytes()
    message = (
        f"Error: {path} was packed but has lost its blob store (the blobs table is gone), so its packed values "
        "cannot be read; nothing was written - restore the file from a backup\n"
    )
    result = runner.invoke(app, ["unpack", str(path)])
    assert (result.exit_code, result.stderr) == (1, message)
    target = tmp_path / "target.db"
    result = runner.invoke(app, ["merge", str(target), str(path)])
    assert (result.exit_code, result.stderr) == (1, message)
    assert path.read_bytes() == before and not target.exists()


def test_verify_names_packed_values_without_their_store_and_does_not_crash(packed_file, tmp_path):
    path = copy(packed_file, tmp_path, "packed.db")
    lose_the_store(path)
    report = verify(path)
    blobs = [p for p in report.problems if p.check == "blobs"]
    assert blobs and all(
        p.what.endswith("holds a packed value, but the file has lost its blob store (its blobs table is gone): restore it from a backup")
        for p in blobs
    )
    # The messages cannot be read back either: named by the content check, no crash.
    assert report.counts["content"] >= 1


def test_proven_blobs_cost_nothing_to_a_whole_file(packed_file, tmp_path):
    """The proofs refuse only what is damaged: a whole packed file unpacks and merges."""
    path = copy(packed_file, tmp_path, "packed.db")
    target = tmp_path / "target.db"
    assert runner.invoke(app, ["merge", str(target), str(path)]).exit_code == 0
    assert runner.invoke(app, ["unpack", str(path)]).exit_code == 0
    assert verify(path).problems == () and verify(target).problems == ()
