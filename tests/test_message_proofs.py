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

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dagsync.cli import app
from dagsync.errors import DagsyncError
from dagsync.verify import verify
from conftest import source_and_target
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
    return source_and_target(request.param, tmp_path_factory)


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


@pytest.mark.parametrize(("case", "said"), [("other-role", "has role"), ("changed-part", "has other parts")])
def test_sync_of_two_files_that_disagree_under_one_key_writes_neither(files, tmp_path, case, said):
    fmt, clean, _ = files
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    shutil.copyfile(clean, a)
    shutil.copyfile(clean, b)
    key = CASES[case](fmt, b)
    before = (a.read_bytes(), b.read_bytes())
    result = runner.invoke(app, ["sync", str(a), str(b)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"hold different content under the same key, so nothing was merged: message {key} {said}" in result.stderr
    assert (a.read_bytes(), b.read_bytes()) == before


# -- the same message with other parts on the two sides: a conflict ------------------------
#
# A message the target holds is not copied, so its proof (above) never reads
# it; merge.shared compares what both files hold under its key instead.


def extra_part(fmt: str, path: Path) -> str:
    """A part more than the message's key stands for, after its last one."""
    (key,) = one(path, LATE_TEXT[fmt])
    table, owner, column = PARTS[fmt]
    if fmt == "dag":
        edit(path, f"INSERT INTO {table} (id, {owner}, \"order\", part_type, {column}) SELECT 'extra-part', ?, "
             f"max(\"order\") + 1, 'text', 'added' FROM {table} WHERE {owner} = ?", (key, key))  # fmt: skip
    else:
        edit(path, f"INSERT INTO {table} ({owner}, position, type, {column}) SELECT ?, max(position) + 1, 'text', "
             f"'added' FROM {table} WHERE {owner} = ?", (key, key))  # fmt: skip
    return key


def other_metadata(fmt: str, path: Path) -> str:
    (key,) = one(path, LATE_TEXT[fmt])
    column, metadata = ("id", "provider_metadata_json") if fmt == "dag" else ("hash", "provider_metadata")
    edit(path, f"UPDATE messages SET {metadata} = '{{\"tampered\": true}}' WHERE {column} = ?", (key,))
    return key


SHARED = {
    "changed-part": (changed_part, "parts"), "nulled-part": (nulled_part, "parts"),
    "lost-part": (lost_part, "parts"), "extra-part": (extra_part, "parts"),
    "other-metadata": (other_metadata, None),
}  # fmt: skip


def conflict(source: Path, target: Path, *descriptions: str) -> str:
    return (
        f"Error: {source} and {target} hold different content under the same key, so nothing was merged: "
        + "; ".join(descriptions) + "\n"
    )  # fmt: skip


def other(key: str, what: str) -> str:
    return f"message {key} has other {what} in the target than in the source, under the same hash"


@pytest.mark.parametrize("case", list(SHARED))
@pytest.mark.parametrize("damaged", ["source", "target"])
def test_the_same_message_with_other_parts_is_a_conflict(files, tmp_path, case, damaged):
    fmt, clean, _ = files
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    shutil.copyfile(clean, source)
    shutil.copyfile(clean, target)  # the same history: every message is in both
    tamper, what = SHARED[case]
    key = tamper(fmt, source if damaged == "source" else target)
    what = what or ("provider_metadata_json" if fmt == "dag" else "provider_metadata")
    before = {p: p.read_bytes() for p in (source, target)}
    for args in (["merge", str(target), str(source)], ["merge", str(target), str(source), "--dry-run"]):
        result = runner.invoke(app, args)
        assert (result.exit_code, result.stderr) == (1, conflict(source, target, other(key, what)))
    assert {p: p.read_bytes() for p in (source, target)} == before


def test_a_second_source_that_disagrees_with_the_first_is_refused(files, tmp_path):
    fmt, clean, unrelated = files
    a, b, target = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "target.db"
    for path in (a, b):
        shutil.copyfile(clean, path)
    shutil.copyfile(unrelated, target)
    key = changed_part(fmt, b)
    before = b.read_bytes()
    # b is merged after a: the target holds a's copy of the message by then, so
    # b's is not copied, and not proven by its key - but compared.
    result = runner.invoke(app, ["merge", str(target), str(a), str(b)])
    assert (result.exit_code, result.stderr) == (1, conflict(b, target, other(key, "parts")))
    # a was merged (sources go in order, each whole or not at all); nothing of b.
    assert b.read_bytes() == before
    table, owner, column = PARTS[fmt]
    assert one(target, f"SELECT count(*) FROM {table} WHERE {owner} = '{key}' AND {column} LIKE '%(tampered)'") == (0,)


def test_an_incremental_merge_compares_what_it_brings(tmp_path):
    """Read from its marks, a source is read only beyond them: a message it
    gained since, which the target has too but with other parts, is still found."""
    one_, two = family(tmp_path / "machines", seed=21, machines=2, conversations=20)
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    shutil.copyfile(one_.path, source)
    shutil.copyfile(one_.path, target)
    assert runner.invoke(app, ["merge", str(target), str(source)]).exit_code == 0  # marks recorded
    for path in (source, target):
        assert runner.invoke(app, ["merge", str(path), str(two.path)]).exit_code == 0
    key = changed_part("dag", target)  # one of the second machine's, in both files now
    dry = runner.invoke(app, ["merge", str(target), str(source), "--dry-run", "--json"])
    assert dry.exit_code == 1 and other(key, "parts") in dry.stderr
    shutil.copyfile(two.path, tmp_path / "clean-two.db")
    untampered = tmp_path / "untampered.db"
    shutil.copyfile(one_.path, untampered)
    assert runner.invoke(app, ["merge", str(untampered), str(source)]).exit_code == 0
    assert runner.invoke(app, ["merge", str(untampered), str(two.path)]).exit_code == 0
    import json

    report = json.loads(runner.invoke(app, ["merge", str(untampered), str(source), "--dry-run", "--json"]).stdout)
    assert report["sources"][0]["incremental"] is True  # the same merge, untampered, reads the delta alone
    before = {p: p.read_bytes() for p in (source, target)}
    result = runner.invoke(app, ["merge", str(target), str(source)])
    assert (result.exit_code, result.stderr) == (1, conflict(source, target, other(key, "parts")))
    assert {p: p.read_bytes() for p in (source, target)} == before


def renamed(path: Path, key: str, new: str) -> None:
    """The dag message ``key`` under the id ``new``: every reference to it follows."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE messages SET id = ? WHERE id = ?", (new, key))
        for (table,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'").fetchall():
            for row in conn.execute(f'PRAGMA foreign_key_list("{table}")').fetchall():
                if row[2] == "messages":
                    conn.execute(f'UPDATE "{table}" SET "{row[3]}" = ? WHERE "{row[3]}" = ?', (new, key))
    conn.close()


def test_a_message_found_under_another_id_with_other_parts_is_a_conflict(tmp_path):
    """dag: the target's row with a source message's identity (parent, content
    hash) is taken for it, its parts not copied: they must be the same."""
    (clean,) = family(tmp_path / "one", seed=23, machines=1, conversations=10)
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    shutil.copyfile(clean.path, source)
    shutil.copyfile(clean.path, target)
    # A message no call or conversation names (their rows would differ too): its parts and children follow.
    (key,) = one(source, (
        "SELECT m.id FROM messages m JOIN message_parts p ON p.message_id = m.id WHERE p.part_type = 'text' "
        "AND m.id NOT IN (SELECT head_input_message_id FROM calls WHERE head_input_message_id IS NOT NULL "
        "UNION SELECT head_output_message_id FROM calls WHERE head_output_message_id IS NOT NULL "
        "UNION SELECT head_message_id FROM conversations WHERE head_message_id IS NOT NULL) "
        "ORDER BY m.rowid DESC LIMIT 1"
    ))  # fmt: skip
    edit(source, "UPDATE message_parts SET content = content || ' (tampered)' WHERE message_id = ?", (key,))
    renamed(source, key, "01MAPPEDMESSAGE0000000000")
    before = {p: p.read_bytes() for p in (source, target)}
    result = runner.invoke(app, ["merge", str(target), str(source)])
    assert (result.exit_code, result.stderr) == (1, conflict(source, target, (
        f"message 01MAPPEDMESSAGE0000000000 (in the target as {key}) has other parts in the target than "
        "in the source, under the same hash"
    )))  # fmt: skip
    assert {p: p.read_bytes() for p in (source, target)} == before
    shutil.copyfile(clean.path, source)  # untampered, under another id: merged onto the target's row
    renamed(source, key, "01MAPPEDMESSAGE0000000000")
    result = runner.invoke(app, ["merge", str(target), str(source), "--json"])
    assert result.exit_code == 0, result.stderr
    import json

    (messages,) = [t for t in json.loads(result.stdout)["sources"][0]["tables"] if t["table"] == "messages"]
    assert (messages["mapped"], messages["added"]) == (1, 0)


def test_packed_and_inline_copies_of_one_message_agree(files, tmp_path):
    """A packed file's parts hold references into its blob store: compared as the
    sha256 they name, they agree with the same parts inline, and a changed one
    is still found."""
    fmt, clean, _ = files
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    shutil.copyfile(clean, source)
    shutil.copyfile(clean, target)
    assert runner.invoke(app, ["pack", str(target), "--threshold", "73"]).exit_code == 0
    result = runner.invoke(app, ["merge", str(target), str(source), "--dry-run"])
    assert result.exit_code == 0, result.stderr
    key = changed_part(fmt, source)
    table, owner, column = PARTS[fmt]
    assert one(target, f"SELECT typeof({column}) FROM {table} WHERE {owner} = '{key}'") == ("blob",)  # a reference
    result = runner.invoke(app, ["merge", str(target), str(source)])
    assert (result.exit_code, result.stderr) == (1, conflict(source, target, other(key, "parts")))
    shutil.copyfile(clean, source)
    assert runner.invoke(app, ["pack", str(source), "--threshold", "73"]).exit_code == 0
    key = changed_part(fmt, target)  # target is packed: its tampered part is inline now
    result = runner.invoke(app, ["merge", str(target), str(source)])
    assert (result.exit_code, result.stderr) == (1, conflict(source, target, other(key, "parts")))


def test_fragment_ids_that_differ_between_files_are_no_conflict(tmp_path):
    """llm: a part's payload names fragments by integer id, which means nothing
    outside its file; merged histories number them differently, and agree."""
    pytest.importorskip("llm")
    one_, two = family_llm(tmp_path / "machines", seed=25, machines=2, conversations=40)
    target = tmp_path / "target.db"
    shutil.copyfile(one_.path, target)
    assert runner.invoke(app, ["merge", str(target), str(two.path)]).exit_code == 0
    differ = sqlite3.connect(f"file:{target}?mode=ro", uri=True)
    differ.execute("ATTACH DATABASE ? AS two", (f"file:{two.path}?mode=ro",))
    (renumbered,) = differ.execute(
        "SELECT count(*) FROM two.parts s JOIN main.parts t ON t.message_hash = s.message_hash AND t.position = s.position "
        "WHERE s.payload LIKE '%text_ref%' AND t.payload IS NOT s.payload"
    ).fetchone()
    differ.close()
    assert renumbered > 0  # the case at hand: one payload, two spellings
    result = runner.invoke(app, ["merge", str(target), str(two.path), "--full"])
    assert result.exit_code == 0, result.stderr


# The law: one key, one content. Whatever of a message the key stands for is
# changed on either side, the merge names that message and writes nothing.
KEY = {"dag": ("id", "provider_metadata_json"), "llm": ("hash", "provider_metadata")}
ORDER = {"dag": '"order"', "llm": "position"}


def tampered(fmt: str, path: Path, key: str, how: str) -> str:
    """Change ``how`` what message ``key`` of ``path`` holds; what a merge must say of it."""
    table, owner, column = PARTS[fmt]
    key_column, metadata = KEY[fmt]
    first = f"(SELECT min({ORDER[fmt]}) FROM {table} WHERE {owner} = :k)"
    if how == "role":
        (theirs,) = one(path, f"SELECT role FROM messages WHERE {key_column} = '{key}'")
        other_role_ = "user" if theirs != "user" else "assistant"
        edit(path, f"UPDATE messages SET role = :r WHERE {key_column} = :k", {"r": other_role_, "k": key})
        return f"role {other_role_!r}"
    if how == "metadata":
        edit(path, f"UPDATE messages SET {metadata} = '{{\"tampered\": 1}}' WHERE {key_column} = :k", {"k": key})
        return f"other {metadata}"
    if how == "changed":
        edit(path, f"UPDATE {table} SET {column} = coalesce({column}, '') || 'x' WHERE {owner} = :k AND {ORDER[fmt]} = {first}", {"k": key})
    elif how == "nulled":
        edit(path, f"UPDATE {table} SET {column} = CASE WHEN {column} IS NULL THEN 'x' END WHERE {owner} = :k AND {ORDER[fmt]} = {first}", {"k": key})
    elif how == "lost":
        lost = f"{owner} = :k AND {ORDER[fmt]} = {first}"
        if fmt == "llm":
            # The part's links go with it: the file stays whole but for the message's content.
            for links in ("part_fragments", "part_attachments"):
                edit(path, f"DELETE FROM {links} WHERE part_id IN (SELECT id FROM {table} WHERE {lost})", {"k": key})
        edit(path, f"DELETE FROM {table} WHERE {lost}", {"k": key})
    else:  # added
        edit(path, (
            f"INSERT INTO {table} (id, {owner}, \"order\", part_type, {column}) SELECT 'extra-part', :k, max(\"order\") + 1, 'text', 'added' "
            f"FROM {table} WHERE {owner} = :k" if fmt == "dag" else
            f"INSERT INTO {table} ({owner}, position, type, {column}) SELECT :k, max(position) + 1, 'text', 'added' FROM {table} WHERE {owner} = :k"
        ), {"k": key})  # fmt: skip
    return "other parts"


@settings(
    max_examples=int(os.environ.get("DAGSYNC_EXAMPLES", 12)), deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # fmt: skip
@given(data=st.data())
def test_law_one_key_one_content(files, data):
    fmt, clean, _ = files
    table, owner, _ = PARTS[fmt]
    keys = [k for (k,) in sqlite3.connect(f"file:{clean}?mode=ro", uri=True).execute(f"SELECT DISTINCT {owner} FROM {table} ORDER BY 1")]
    key = data.draw(st.sampled_from(keys), label="message")
    how = data.draw(st.sampled_from(["role", "metadata", "changed", "nulled", "lost", "added"]), label="how")
    side = data.draw(st.sampled_from(["source", "target"]), label="side")
    with tempfile.TemporaryDirectory() as d:
        source, target = Path(d) / "source.db", Path(d) / "target.db"
        shutil.copyfile(clean, source)
        shutil.copyfile(clean, target)
        (key_column, _) = KEY[fmt]
        said = tampered(fmt, source if side == "source" else target, key, how)
        if how == "role":
            (ours,) = one(source, f"SELECT role FROM messages WHERE {key_column} = '{key}'")
            (theirs,) = one(target, f"SELECT role FROM messages WHERE {key_column} = '{key}'")
            description = f"message {key} has role {theirs!r} in the target but {ours!r} in the source, under the same hash"
        else:
            description = f"message {key} has {said} in the target than in the source, under the same hash"
        before = {p: p.read_bytes() for p in (source, target)}
        result = runner.invoke(app, ["merge", str(target), str(source)])
        assert (result.exit_code, result.stderr) == (1, conflict(source, target, description))
        assert {p: p.read_bytes() for p in (source, target)} == before
