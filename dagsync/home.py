"""llm's home: where llm keeps its database, and what a database argument names.

The home itself (``$LLM_USER_PATH``, else llm's app directory) is found by
the command line, which holds the one function that knows the platform's
app directory (``cli.llm_directory``); everything here takes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from dagsync.errors import DagsyncError

__all__ = ["database_in", "is_own", "own_database", "resolve"]

# The files llm writes in its home: the DAG branch's, else released llm's.
NAMES = ("dag.db", "logs.db")


def database_in(directory: Path) -> Path | None:
    """``directory``'s dag.db, else its logs.db, else None."""
    for name in NAMES:
        if (directory / name).exists():
            return directory / name
    return None


def own_database(home: Path) -> Path:
    """llm's own database in its ``home``.

    :raises DagsyncError: neither dag.db nor logs.db is there.
    """
    found = database_in(home)
    if found is None:
        raise DagsyncError(
            f"no database given, and llm's directory {home} has neither dag.db "
            "nor logs.db; pass the database file as an argument"
        )
    return found


def resolve(path: Path | None, home: Callable[[], Path]) -> Path:
    """The file a database argument names: llm's own (in ``home()``) when left
    out, and the database inside when it names a directory (an llm home, as
    LLM_USER_PATH would).

    :raises DagsyncError: no database where it should be.
    """
    if path is None:
        return own_database(home())
    if path.is_dir():
        found = database_in(path)
        if found is None:
            raise DagsyncError(
                f"{path} is a directory with neither dag.db nor logs.db in it; "
                "pass the database file, or llm's home directory"
            )
        return found
    return path


def is_own(path: Path, home: Path) -> bool:
    """Whether ``path`` is a database llm itself writes to, in its ``home``."""
    for name in NAMES:
        own = home / name
        try:
            if own.exists() and os.path.samefile(own, path):
                return True
        except OSError:
            pass
    return False
