from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from dagsync.store import MessageStore

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


@pytest.fixture
def store(tmp_path: Path):
    with MessageStore.open(tmp_path / "store.db") as s:
        yield s
