"""Every message a merge copies is proven by its own key first: a damaged one is
named, the merge refuses, and nothing at all is written.

A tamper test per way a message can be wrong under an unchanged key, in both
formats: the exact one-line message, exit status 1, and every file byte for
byte as it was - into a new target, into an existing one, as a dry run, and
through sync. The digest a message "hashes to" is taken from ``verify``, which
re-hashes every message on its own (the same contract, another code path
through the file).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dagsync.cli import app
from dagsync.errors import DagsyncError
from dagsync.verify import verify
from fixtures import family, family_llm

runner = CliRunner()


@pytest.fixture(autouse=True)
def short_transactions_of_a_few_rows(monkeypatch):
    """Every chunk its own committed transaction, as beside a live llm: a refusal
    that came only after some chunks were written would leave them behind."""
    import contextlib

    import dagsync.transactions
    import dagsync.writer

    monkeypatch.setattr(dagsync.transactions, "long_transactions", lambda conn: contextlib.nullcontext())
    for name in ("FIRST_CHUNK", "MAX_READ_CHUNK", "MAX_WRITE_CHUNK", "ALONE_MAX_WRITE_CHUNK"):
        monkeypatch.setattr(dagsync.writer, name, 20)


@pytest.fixture(scope="module", params=["dag", "llm"])
def files(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(format, a source, an unrelated existing target) of that format."""
    directory = tmp_path_factory.mktemp(f"proofs-{request.param}")
    make = family if request.param == "dag" else family_llm
    if request.param == "llm":
        pytest.importorskip("llm")
    source = make(directory / "src", seed=11, machines=1, conversations=30)[0].path
    target = make(directory / "tgt", seed=12, machines=1, conversations=5)[0].path
    return request.param, source, target


def edit(path: Path, sql: str, params: tuple = ()) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(sql, params)
    conn.close()


def one(path: Path, sql: str) -> tuple:
    with sqlite3.connect(path) as conn:
        row = conn.execute(sql).fetchone()
    conn.close()
    return row


# Each case damages the last message that has a text part (so that a refusal
# that came late would have written rows before it) and returns its key.
LATE_TEXT = {
    "dag": "SELECT m.id FROM messages m JOIN message_parts p ON p.message_id = m.id "
    "WHERE p.part_type = 'text' AND p.content != '' ORDER BY m.rowid DESC LIMIT 1",
    "llm": "SELECT m.hash FROM messages m JOIN parts p ON p.message_hash = m.hash "
    "WHERE p.type = 'text' AND p.text != '' ORDER BY m.rowid DESC LIMIT 1",
}
PARTS = {"dag": ("message_parts", "message_id", "content"), "llm": ("parts", "message_hash", "text")}


def changed_part(fmt: str, path: Path) -> str:
    (key,) = one(path, LATE_TEXT[fmt])
    table, owner, column = PARTS[fmt]
    edit(path, f"UPDATE {table} SET {column} = {column} || ' (tampered)' WHERE {owner} = ?", (key,))
    return key


def nulled_part(fmt: str, path: Path) -> str:
    (key,) = one(path, LATE_TEXT[fmt])
    table, owner, column = PARTS[fmt]
    edit(path, f"UPDATE {table} SET {column} = NULL WHERE {owner} = ?", (key,))
    return key


def lost_part(fmt: str, path: Path) -> str:
    (key,) = one(path, LATE_TEXT[fmt])
    table, owner, _ = PARTS[fmt]
    edit(path, f"DELETE FROM {table} WHERE {owner} = ? AND rowid = (SELECT max(rowid) FROM {table} WHERE {owner} = ?)", (key, key))
    return key


def other_role(fmt: str, path: Path) -> str:
    (key,) = one(path, LATE_TEXT[fmt])
    column = "id" if fmt == "dag" else "hash"
    edit(path, f"UPDATE messages SET role = CASE role WHEN 'user' THEN 'assistant' ELSE 'user' END WHERE {column} = ?", (key,))
    return key


CASES = {"changed-part": changed_part, "nulled-part": nulled_part, "lost-part": lost_part, "other-role": other_role}


def refusal(source: Path, key: str) -> str:
    (what,) = [p.what for p in verify(source).problems if p.check == "content" and p.key == key]
    return (
        f"Error: {source}: message {key} does not match its key: {what}; it was not copied, and nothing "
        f"was merged - run `dagsync verify {source}` to see every damaged row, and restore the source from a backup\n"
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("into", ["new-target", "existing-target", "dry-run"])
def test_merge_refuses_a_message_that_does_not_match_its_key(files, tmp_path, case, into):
    fmt, clean, unrelated = files
    source = tmp_path / "source.db"
    shutil.copyfile(clean, source)
    key = CASES[case](fmt, source)
    target = tmp_path / "target.db"
    if into != "new-target":
        shutil.copyfile(unrelated, target)
    before = {p: p.read_bytes() for p in (source, target) if p.exists()}
    args = ["merge", str(target), str(source), *(["--dry-run"] if into == "dry-run" else [])]
    result = runner.invoke(app, args)
    assert (result.exit_code, result.stderr) == (1, refusal(source, key))
    assert {p: p.read_bytes() for p in (source, target) if p.exists()} == before
    assert target.exists() == (into != "new-target")


def test_sync_refuses_a_damaged_side_and_writes_neither(files, tmp_path):
    fmt, clean, unrelated = files
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    shutil.copyfile(clean, a)
    shutil.copyfile(unrelated, b)
    key = changed_part(fmt, a)
    before = (a.read_bytes(), b.read_bytes())
    result = runner.invoke(app, ["sync", str(a), str(b)])
    assert result.exit_code == 1
    assert result.stderr.endswith(refusal(a, key))
    assert (a.read_bytes(), b.read_bytes()) == before


def test_a_whole_source_is_proven_and_merged(files, tmp_path):
    """The proof refuses only what is damaged, and a re-merge (nothing to copy) proves nothing."""
    fmt, clean, unrelated = files
    target = tmp_path / "target.db"
    shutil.copyfile(unrelated, target)
    assert runner.invoke(app, ["merge", str(target), str(clean)]).exit_code == 0
    assert verify(target).problems == ()
    import dagsync.merge.proofs as proofs

    started = []
    original = proofs.MessageProofs.__init__
    proofs.MessageProofs.__init__ = lambda self, *a: (started.append(1), original(self, *a))[1]
    try:
        assert runner.invoke(app, ["merge", str(target), str(clean)]).exit_code == 0
    finally:
        proofs.MessageProofs.__init__ = original
    assert started == []


def test_the_proof_is_what_stops_the_merge(files, tmp_path, monkeypatch):
    """Without it, the damaged message is copied and the target fails verify: the
    tamper cases above test the proof, not some other check."""
    import dagsync.merge.proofs as proofs

    fmt, clean, _ = files
    source = tmp_path / "source.db"
    shutil.copyfile(clean, source)
    key = changed_part(fmt, source)
    monkeypatch.setattr(proofs.MessageProofs, "start", classmethod(lambda cls, run, key: None))
    target = tmp_path / "target.db"
    assert runner.invoke(app, ["merge", str(target), str(source)]).exit_code == 0
    assert any(p.check == "content" and p.key == key for p in verify(target).problems)


# -- rows keyed by a hash of their content: fragments, attachments, schemas ---------------

KEYED = {
    "dag": {"fragments": ("hash", "content"), "attachments": ("id", "content")},
    "llm": {"fragments": ("hash", "content"), "attachments": ("id", "content"), "schemas": ("id", "content")},
}


def test_merge_refuses_a_row_whose_content_does_not_give_its_key(files, tmp_path, monkeypatch):
    """Each table of the format keyed by a hash of its content, one at a time."""
    import dagsync.merge.proofs as proofs

    # The messages that use the row would be refused too; this proves the row's own check.
    monkeypatch.setattr(proofs.MessageProofs, "start", classmethod(lambda cls, run, key: None))
    fmt, clean, _ = files
    for table, (key_column, column) in KEYED[fmt].items():
        source = tmp_path / f"source-{table}.db"
        shutil.copyfile(clean, source)
        (key,) = one(source, f'SELECT "{key_column}" FROM {table} WHERE length({column}) > 0 ORDER BY rowid DESC LIMIT 1')
        edit(source, f"UPDATE {table} SET {column} = CAST({column} || ' (tampered)' AS BLOB) WHERE \"{key_column}\" = ?", (key,))
        (what,) = [p.what for p in verify(source).problems if p.check == "keys" and p.table == table and p.key == str(key)]
        digest = what.removeprefix("its content hashes to ").removesuffix(", not to its key")
        target = tmp_path / f"target-{table}.db"
        before = source.read_bytes()
        result = runner.invoke(app, ["merge", str(target), str(source)])
        assert (result.exit_code, result.stderr) == (1, (
            f"Error: {source}: {table} {key} does not match its key: its content hashes to {digest}; it was not "
            f"copied, and nothing was merged - run `dagsync verify {source}` to see every damaged row, and restore "
            "the source from a backup\n"
        ))  # fmt: skip
        assert source.read_bytes() == before and not target.exists()


def test_a_copy_that_ran_ahead_of_the_proofs_is_rolled_back(files, tmp_path, monkeypatch):
    """In one long transaction (nobody else has the file open) the copy does not
    wait for the proofs; its commit does. Proofs slowed down so that the whole
    copy is done first: the refusal still leaves every file as it was."""
    import time

    import dagsync.merge.proofs as proofs
    import dagsync.transactions
    from dagsync.merge import merge

    monkeypatch.undo()  # long transactions and full-size chunks, as a merge alone runs
    fmt, clean, unrelated = files
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    shutil.copyfile(clean, source)
    shutil.copyfile(unrelated, target)
    key = changed_part(fmt, source)
    before = {p: p.read_bytes() for p in (source, target)}
    slow = {"dag": proofs.dag_failures, "llm": proofs.llm_failures}[fmt]

    def slowly(*args, **kwargs):
        time.sleep(1.5)
        yield from slow(*args, **kwargs)

    monkeypatch.setattr(proofs, f"{fmt}_failures", slowly)
    long_blocks = []
    original = dagsync.transactions.long_transactions

    def counted(conn):
        long_blocks.append(conn)
        return original(conn)

    monkeypatch.setattr(dagsync.transactions, "long_transactions", counted)
    import dagsync.merge.messages as messages

    copy = messages.apply
    copied = []
    monkeypatch.setattr(messages, "apply", lambda run, table: (copy(run, table), copied.append(run.conn.in_transaction)))
    with pytest.raises(DagsyncError) as info:
        merge(target, [source])
    assert str(info.value) == refusal(source, key).removeprefix("Error: ").removesuffix("\n")
    # Every message was copied, inside the long transaction, before the proofs said no.
    assert copied == [True], "the copy did not run ahead of the proofs: the test proved nothing"
    assert long_blocks
    assert {p: p.read_bytes() for p in (source, target)} == before


# -- the same key with other content on the two sides: a conflict -------------------------


def test_the_same_message_with_another_role_is_a_conflict(files, tmp_path):
    fmt, clean, _ = files
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    shutil.copyfile(clean, source)
    shutil.copyfile(clean, target)  # the same history: every message is in both
    key = other_role(fmt, source)
    column = "id" if fmt == "dag" else "hash"
    (theirs,) = one(source, f"SELECT role FROM messages WHERE {column} = '{key}'")
    (ours,) = one(target, f"SELECT role FROM messages WHERE {column} = '{key}'")
    before = {p: p.read_bytes() for p in (source, target)}
    result = runner.invoke(app, ["merge", str(target), str(source)])
    assert (result.exit_code, result.stderr) == (1, (
        f"Error: {source} and {target} hold different content under the same key, so nothing was merged: "
        f"message {key} has role {ours!r} in the target but {theirs!r} in the source, under the same hash\n"
    ))  # fmt: skip
    assert {p: p.read_bytes() for p in (source, target)} == before


def test_the_same_fragment_with_other_content_is_a_conflict(files, tmp_path):
    fmt, clean, _ = files
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    shutil.copyfile(clean, source)
    shutil.copyfile(clean, target)
    (digest,) = one(source, "SELECT hash FROM fragments ORDER BY rowid DESC LIMIT 1")
    edit(source, "UPDATE fragments SET content = content || ' (tampered)' WHERE hash = ?", (digest,))
    before = {p: p.read_bytes() for p in (source, target)}
    result = runner.invoke(app, ["merge", str(target), str(source)])
    assert (result.exit_code, result.stderr) == (1, (
        f"Error: {source} and {target} hold different content under the same key, so nothing was merged: "
        f"fragments {digest} differs between the two files\n"
    ))  # fmt: skip
    assert {p: p.read_bytes() for p in (source, target)} == before


def test_sync_of_two_files_that_disagree_under_one_key_writes_neither(files, tmp_path):
    fmt, clean, _ = files
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    shutil.copyfile(clean, a)
    shutil.copyfile(clean, b)
    key = other_role(fmt, b)
    before = (a.read_bytes(), b.read_bytes())
    result = runner.invoke(app, ["sync", str(a), str(b)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"hold different content under the same key, so nothing was merged: message {key} has role" in result.stderr
    assert (a.read_bytes(), b.read_bytes()) == before
