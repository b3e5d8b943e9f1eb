from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from dagsync.store import MessageStore
from fixtures import family, family_llm

ROOT_DIR = Path(__file__).resolve().parents[1]
# ../shared beside the project root, when this checkout has one.
SHARED = ROOT_DIR.parent / "shared"
DATA = Path(__file__).resolve().parent / "data"

settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("default")


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    """What dagsync remembers between runs (push's MarksCache) goes to a folder of
    the test session's, for every process the tests start, never to ~/.cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture
def store(tmp_path: Path):
    with MessageStore.open(tmp_path / "store.db") as s:
        yield s


def source_and_target(fmt: str, tmp_path_factory) -> tuple[str, Path, Path]:
    """(``fmt``, a 30-conversation source, an unrelated 5-conversation target) of that
    format: the files the tamper tests damage copies of."""
    directory = tmp_path_factory.mktemp(f"tamper-{fmt}")
    make = family if fmt == "dag" else family_llm
    if fmt == "llm":
        pytest.importorskip("llm")
    source = make(directory / "src", seed=11, machines=1, conversations=30)[0].path
    target = make(directory / "tgt", seed=12, machines=1, conversations=5)[0].path
    return fmt, source, target
