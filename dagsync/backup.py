"""A consistent copy of a database, beside a running llm (``pack --output``)."""

from __future__ import annotations

import os
from pathlib import Path

import apsw

from dagsync.db import READ_BUSY_TIMEOUT_MS, create_private_file, harden, open_source
from dagsync.errors import DagsyncError
from dagsync.transactions import patient

__all__ = ["copy_database"]

# Pages copied per step of ``copy_database``: between steps a writer may commit.
COPY_STEP_PAGES = 4096


def copy_database(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """A consistent copy of ``source`` as the new file ``dest`` (0600), made
    with SQLite's backup API a step at a time: a running llm may go on
    writing ``source`` (the copy then starts over from the file as it is).

    :raises DagsyncError: ``dest`` exists; ``source`` is not a database dagsync knows.
    """
    source, dest = Path(source), Path(dest)
    open_source(source, quick_check=False).close()
    try:
        create_private_file(dest)
    except FileExistsError:
        raise DagsyncError(f"{dest} already exists; give a new file to copy into, or remove it first") from None
    try:
        src = apsw.Connection(str(source), flags=apsw.SQLITE_OPEN_READONLY)
        dst = apsw.Connection(str(dest))
        try:
            harden(src)
            patient(src, READ_BUSY_TIMEOUT_MS)
            with dst.backup("main", src, "main") as backup:
                while not backup.done:
                    backup.step(COPY_STEP_PAGES)
        finally:
            dst.close()
            src.close()
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
