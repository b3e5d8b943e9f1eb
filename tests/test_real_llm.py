"""Databases written by the real llm 0.36 CLI (with the offline llm-echo model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dagsync.canonical import content_hash
from dagsync.db import open_source
from dagsync.formats.llm import LLM
from dagsync.message import Message
from dagsync.stats import stats

llm = pytest.importorskip("llm")


def prompt(user_dir: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "llm", "-m", "echo", *args],
        env={**os.environ, "LLM_USER_PATH": str(user_dir)},
        check=True, capture_output=True, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def logs_db(tmp_path_factory) -> Path:
    user_dir = tmp_path_factory.mktemp("llm")
    prompt(user_dir, "-s", "be brief", "hi there")
    prompt(user_dir, "-c", "and again")
    prompt(user_dir, "-s", "be brief", "hi there")  # the same first turn: shared rows
    prompt(user_dir, "a new thread")
    return user_dir / "logs.db"


def test_a_real_logs_db_passes_every_check_and_is_the_llm_format(logs_db):
    with open_source(logs_db) as db:
        assert db.format is LLM


def test_stats_counts_threads_and_turns(logs_db):
    s = stats(logs_db)
    assert (s.format, s.conversations, s.calls) == ("llm", 3, 4)
    assert s.tables["turn_search"] == 4


def test_llm_message_dicts_load_as_our_values():
    from llm.parts import Message as LlmMessage, ReasoningPart, TextPart, ToolCallPart

    theirs = LlmMessage(
        "assistant",
        [ReasoningPart("hm", redacted=True), TextPart("hi", {"sig": "x"}), ToolCallPart("f", {"a": 1}, "c1")],
    )
    ours = Message.from_dict(theirs.to_dict())
    assert ours.to_dict() == theirs.to_dict()
    assert LlmMessage.from_dict(ours.to_dict()) == theirs
    assert len(content_hash(ours)) == 64
