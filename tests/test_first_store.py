"""Files packed by the first blob store (before 2026-12-07) keep being read, and written into.

``tests/data/first-store-*.db.zst`` were made by dagsync at c1c19af, the last
commit of that store: the fixture generator's family (seed 3, 40
conversations), machine 1, packed with ``pack --dict --vacuum``; beside each,
the same file before the pack (``-plain``). Their references in columns of
text are 72-byte BLOBs (``dagsync:`` and hex), and their blobs name their
dictionary by its hash (docs/blobs.md, "The first store"). Every command
reads them; what a merge or pack adds to one is in the short form, so such a
file holds both.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import zstandard

from dagsync.blobs import pack
from dagsync.errors import BlobError
from dagsync.formats.dag import DAG
from dagsync.formats.llm import LLM
from dagsync.forget import forget
from dagsync.forget.select import Selector
from dagsync.gc import gc
from dagsync.merge import merge
from dagsync.unpack import unpack
from dagsync.verify import verify
from fixtures import family, family_llm
from tests.history import content_dump

DATA = Path(__file__).parent / "data"
FORMATS = {"dag": (DAG, family, "conversations"), "llm": (LLM, family_llm, "threads")}
FAR_FUTURE = 4_000_000_000.0  # every grace period over


def dump(path: Path) -> list[str]:
    """Every row llm reads, without dagsync's bookkeeping and the blob store."""
    return content_dump(path, ("_dagsync_", "blob_dicts", 'INTO "blobs"', "TABLE blobs"))


def first_store(tmp_path: Path, fmt: str, plain: bool = False) -> Path:
    name = f"first-store-{fmt}{'-plain' if plain else ''}.db"
    out = tmp_path / name
    with open(DATA / f"{name}.zst", "rb") as src, open(out, "wb") as dst:
        zstandard.ZstdDecompressor().copy_stream(src, dst)
    return out


def machine_2(tmp_path: Path, fmt: str) -> Path:
    """The other machine of the family the first-store files were made from."""
    return FORMATS[fmt][1](tmp_path / "family", seed=3, machines=2, conversations=40)[1].path


def forms(path: Path, fmt: str) -> dict[str, int]:
    """How many references of each form the file's columns of text hold, and how its blobs name dictionaries.

    Written from docs/blobs.md, not from dagsync's own SQL."""
    counts = {"short": 0, "first": 0}
    with sqlite3.connect(path) as conn:
        present = {n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        for column in FORMATS[fmt][0].packed:
            if column.holds != "text" or column.table not in present:
                continue
            for length, n in conn.execute(
                f'SELECT length("{column.column}"), count(*) FROM "{column.table}" '
                f"WHERE typeof(\"{column.column}\") = 'blob' AND substr(\"{column.column}\", 1, 8) = CAST('dagsync:' AS BLOB) "
                "GROUP BY 1"
            ):
                counts[{40: "short", 72: "first"}[length]] += n
        for kind, n in conn.execute("SELECT typeof(dict), count(*) FROM blobs WHERE dict IS NOT NULL GROUP BY 1"):
            counts[f"dict by {kind}"] = n
    conn.close()
    return counts


def referred(path: Path, fmt: str) -> set[str]:
    """The hashes every reference of the file names, in either form."""
    hashes: set[str] = set()
    with sqlite3.connect(path) as conn:
        present = {n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        for column in FORMATS[fmt][0].packed:
            if column.table not in present:
                continue
            for (value,) in conn.execute(f'SELECT "{column.column}" FROM "{column.table}"'):
                if column.holds == "text" and isinstance(value, bytes) and value.startswith(b"dagsync:"):
                    hashes.add(value[8:].hex() if len(value) == 40 else value[8:].decode())
                elif column.holds == "blob" and isinstance(value, str) and value.startswith("dagsync:"):
                    hashes.add(value[8:])
    conn.close()
    return hashes


def blobs_of(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        hashes = {h for (h,) in conn.execute("SELECT hash FROM blobs")}
    conn.close()
    return hashes


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_first_store_file_verifies_and_unpacks_to_what_was_packed(tmp_path, fmt):
    path, plain = first_store(tmp_path, fmt), first_store(tmp_path, fmt, plain=True)
    assert forms(path, fmt)["first"] > 0 and forms(path, fmt)["short"] == 0
    assert any(k.startswith("dict by text") for k in forms(path, fmt))  # blobs name dictionaries by hash
    assert verify(path).problems == ()
    report = unpack(path)
    assert report.values > 0
    assert dump(path) == dump(plain)
    assert verify(path).problems == ()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_first_store_file_merges_as_a_source_into_plain_and_packed_targets(tmp_path, fmt):
    source, plain = first_store(tmp_path, fmt), first_store(tmp_path, fmt, plain=True)
    other = machine_2(tmp_path, fmt)
    expected_dir, plain_dir, packed_dir = (tmp_path / n for n in ("expected", "plain", "packed"))
    for d in (expected_dir, plain_dir, packed_dir):
        d.mkdir()
        shutil.copyfile(other, d / "t.db")
    # The same source name everywhere: a fork row is named after the file its branch came from.
    shutil.copyfile(plain, expected_dir / "s.db")
    shutil.copyfile(source, plain_dir / "s.db")
    shutil.copyfile(source, packed_dir / "s.db")
    merge(expected_dir / "t.db", [expected_dir / "s.db"])
    merge(plain_dir / "t.db", [plain_dir / "s.db"])
    assert verify(plain_dir / "t.db").problems == ()
    assert dump(plain_dir / "t.db") == dump(expected_dir / "t.db")
    # Into a target of the new store: blobs come by key, their dictionary named by id.
    pack(packed_dir / "t.db", dictionary=True)
    merge(packed_dir / "t.db", [packed_dir / "s.db"])
    assert verify(packed_dir / "t.db").problems == ()
    assert forms(packed_dir / "t.db", fmt)["first"] == 0
    assert set(forms(packed_dir / "t.db", fmt)) <= {"short", "first", "dict by integer"}
    assert merge(packed_dir / "t.db", [packed_dir / "s.db"]).sources[0].written == 0
    unpack(packed_dir / "t.db")
    assert dump(packed_dir / "t.db") == dump(expected_dir / "t.db")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_merge_into_a_first_store_file_adds_short_references_and_unpacks_whole(tmp_path, fmt):
    # The same target name both ways: a fork row is named after the file its branch came from.
    for d in ("src", "packed", "plain"):
        (tmp_path / d).mkdir()
    target, plain = tmp_path / "packed" / "t.db", tmp_path / "plain" / "t.db"
    first_store(tmp_path, fmt).rename(target)
    first_store(tmp_path, fmt, plain=True).rename(plain)
    source = tmp_path / "src" / "s.db"
    shutil.copyfile(machine_2(tmp_path, fmt), source)
    pack(source, dictionary=True)  # a source of the new store: its dictionary named by id
    merge(plain, [source])
    merge(target, [source])
    assert verify(target).problems == ()
    both = forms(target, fmt)
    assert both["first"] > 0 and both["short"] > 0  # one file, both forms
    assert "dict by integer" not in both  # the first store's blobs name dictionaries by hash, new ones too
    assert merge(target, [source]).sources[0].written == 0
    pack(target)  # nothing left inline: nothing to do
    unpack(target)
    assert dump(target) == dump(plain)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forget_and_gc_on_a_first_store_file_free_exactly_the_blobs_nothing_refers_to(tmp_path, fmt):
    path, plain = first_store(tmp_path, fmt), first_store(tmp_path, fmt, plain=True)
    table = FORMATS[fmt][2]
    with sqlite3.connect(plain) as conn:
        ids = tuple(i for (i,) in conn.execute(f"SELECT id FROM {table} ORDER BY rowid LIMIT 5"))
    conn.close()
    before = blobs_of(path)
    for f in (path, plain):
        forget(f, Selector(ids=ids), now=FAR_FUTURE)
        gc(f, now=FAR_FUTURE)
    assert verify(path).problems == ()
    after = blobs_of(path)
    assert after < before  # the forgotten conversations' own payloads went
    assert after == referred(path, fmt)  # and nothing any remaining row refers to
    unpack(path)
    assert dump(path) == dump(plain)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_blob_of_a_first_store_reference_is_named_and_nothing_is_written(tmp_path, fmt):
    path = first_store(tmp_path, fmt)
    column = next(c for c in FORMATS[fmt][0].packed if c.holds == "text" and c.table in ("message_parts", "parts"))
    with sqlite3.connect(path) as conn:
        (value,) = conn.execute(
            f'SELECT "{column.column}" FROM "{column.table}" WHERE typeof("{column.column}") = \'blob\' ORDER BY rowid DESC LIMIT 1'
        ).fetchone()
        key = value[8:].decode()
        conn.execute("DELETE FROM blobs WHERE hash = ?", (key,))
    conn.close()
    assert any(p.check == "blobs" and p.what.endswith(f"refers to blob {key}, which is missing") for p in verify(path).problems)
    before = path.read_bytes()
    with pytest.raises(BlobError) as info:
        unpack(path)
    assert str(info.value) == (
        f"{path}: blob {key} is missing; its blob store is damaged and nothing was written - "
        f"run `dagsync verify {path}` to see all of it, and restore the file from a backup"
    )
    assert path.read_bytes() == before
