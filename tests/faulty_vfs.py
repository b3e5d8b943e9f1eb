"""A test-only SQLite VFS that fails the Nth read, write or sync, as SQLite's own
fault-injection tests do (``test_syscall fault``, ``sysfault.test``).

``FaultyVFS`` wraps the default VFS and becomes the default for as long as it
is installed, so every connection dagsync opens - the target, the attached
sources, the temp files, the threads' own connections - goes through it. It
counts every read, write and sync of every file; with a fault armed, the Nth
operation of that kind raises the chosen SQLite error once (a transient
fault) and everything after it succeeds. Nothing of this is in dagsync's CLI.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import apsw

__all__ = ["Fault", "FaultyVFS", "installed"]

ERRORS = {"full": apsw.FullError, "ioerr": apsw.IOError}


@dataclass
class Fault:
    kind: str  # "read", "write" or "sync"
    nth: int  # 1-based
    error: str = "ioerr"  # "full" or "ioerr"


@dataclass
class FaultyVFS:
    fault: Fault | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0, "sync": 0})
    fired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tick(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            fire = self.fault is not None and not self.fired and kind == self.fault.kind and self.counts[kind] == self.fault.nth
            if fire:
                self.fired = True
        if fire:
            raise ERRORS[self.fault.error](f"injected fault: {self.fault.error} on {kind} #{self.fault.nth}")


class _VFS(apsw.VFS):
    def __init__(self, state: FaultyVFS, base: str) -> None:
        self.state, self.base = state, base
        super().__init__("faulty", base, makedefault=True)

    def xOpen(self, name, flags):  # noqa: N802 - APSW's name
        return _File(self.state, self.base, name, flags)


class _File(apsw.VFSFile):
    def __init__(self, state: FaultyVFS, base: str, name, flags) -> None:
        self.state = state
        super().__init__(base, name, flags)

    def xRead(self, amount, offset):  # noqa: N802
        self.state.tick("read")
        return super().xRead(amount, offset)

    def xWrite(self, data, offset):  # noqa: N802
        self.state.tick("write")
        return super().xWrite(data, offset)

    def xSync(self, flags):  # noqa: N802
        self.state.tick("sync")
        return super().xSync(flags)


@contextlib.contextmanager
def installed(fault: Fault | None = None) -> Iterator[FaultyVFS]:
    """Every connection opened inside goes through a counting VFS that injects ``fault``."""
    state = FaultyVFS(fault)
    base = apsw.vfs_names()[0]
    vfs = _VFS(state, base)
    try:
        yield state
    finally:
        vfs.unregister()
