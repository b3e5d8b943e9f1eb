"""Incremental merges of real llm 0.36 files: a hub merges two machines, they
go on (threads continued on both, new threads, fragments, attachments and
tools used again by id), and the hub's next merge, from the marks, ends with
exactly the rows a full merge gives; llm lists and verifies it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("llm")
sqlite_utils = pytest.importorskip("sqlite_utils")
from llm.logs import LogStore  # noqa: E402

from dagsync.merge import merge  # noqa: E402
from tests.test_incremental import merged_both_ways, rows  # noqa: E402
from tests.test_real_llm_merge import TOOL_CALL, png, prompt, responses  # noqa: E402


@pytest.fixture(scope="module")
def homes(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("incremental")
    files = root / "files"
    files.mkdir()
    (files / "shared.txt").write_text("A shared fragment about the pelican.\n")
    (files / "red.png").write_bytes(png(255, 0, 0))
    shared = root / "shared"
    prompt(shared, "-s", "You are terse.", "hello")
    prompt(shared, "-f", str(files / "shared.txt"), "summarise the fragment")
    prompt(shared, "-a", str(files / "red.png"), "describe the image")
    prompt(shared, "-T", "llm_version", TOOL_CALL)
    laptop, server = root / "laptop", root / "server"
    shutil.copytree(shared, laptop)
    shutil.copytree(shared, server)
    prompt(laptop, "-c", "the laptop goes on")
    prompt(server, "the server starts its own thread")
    return root, laptop / "logs.db", server / "logs.db"


def go_on(laptop: Path, server: Path, files: Path, word: str) -> None:
    """Both machines go on: a thread continued on each (the same one: it diverges),
    fragments, attachments and a tool used again, a new thread."""
    prompt(laptop.parent, "-c", f"the laptop says {word}")
    prompt(server.parent, "-c", f"the server says {word}")
    prompt(laptop.parent, "-f", str(files / "shared.txt"), f"the fragment again, {word}")
    prompt(server.parent, "-a", str(files / "red.png"), f"the image again, {word}")
    prompt(laptop.parent, "-T", "llm_version", TOOL_CALL)
    prompt(server.parent, "-s", "You are terse.", "hello")
    prompt(laptop.parent, f"a new laptop thread about {word}")


def test_a_hub_merging_from_marks_ends_as_full_merges_do_and_llm_reads_it(homes):
    root, laptop, server = homes
    hub = root / "hub" / "logs.db"
    hub.parent.mkdir()
    merge(hub, [laptop, server])
    for word in ("alpaca", "zeppelin"):
        go_on(laptop, server, root / "files", word)
        for source in (laptop, server):
            mine, full = merged_both_ways(hub, source)
            assert mine.incremental, mine.full_because
            assert mine.written == full.written
    again = merge(hub, [laptop, server])
    assert all(s.incremental and s.written == 0 for s in again.sources)
    # llm reads the hub: every response of both machines, and every message proven.
    assert set(responses(laptop)) | set(responses(server)) == set(responses(hub))
    assert LogStore(sqlite_utils.Database(hub)).verify() == []
    full = root / "hub-full.db"
    merge(full, [laptop, server])
    for source in (laptop, server):
        merge(full, [source], full=True)
    assert set(responses(full)) == set(responses(hub))
    assert rows(hub)["messages"] == rows(full)["messages"]
