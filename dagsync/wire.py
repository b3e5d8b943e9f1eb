"""The wire between push and pull's two ends: a bundle file as one header line,
``DAGSYNC-BUNDLE 1 <bytes> <sha256>``, then the file in one zstd frame. The
receiving side writes it to a new file (0600) and proves it whole (size and
hash) before anyone merges it, so a connection cut at any byte leaves
nothing half-read behind (``remote``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import zstandard

from dagsync.errors import DagsyncError
from dagsync.writer import Progress

__all__ = ["read_wire", "scratch_beside", "write_wire"]

MAGIC = b"DAGSYNC-BUNDLE 1"
CHUNK = 1 << 20
LEVEL = 3


def write_wire(path: Path, out: IO[bytes], progress: Progress | None = None) -> int:
    """Write the bundle at ``path`` to ``out``: header, then one zstd frame. Bytes
    written. ``progress`` hears ``("sending", bytes of the bundle read, its size)``."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
            size += len(block)
    header = MAGIC + f" {size} {digest.hexdigest()}\n".encode()
    out.write(header)
    counted = _Counting(out)
    with open(path, "rb") as f:
        source = _ReadingProgress(f, size, progress) if progress is not None else f
        zstandard.ZstdCompressor(level=LEVEL, write_checksum=True).copy_stream(source, counted, size=size)
    out.flush()
    return len(header) + counted.n


def read_wire(stream: IO[bytes], dest: Path, progress: Progress | None = None) -> int:
    """Read a bundle from ``stream`` into ``dest`` (a new file, 0600), proving it
    whole; the bytes read off the wire. ``progress`` hears ``("receiving",
    bytes of the bundle so far, its size)``.

    :raises DagsyncError: not a bundle, or it arrived incomplete or changed.
    """
    header = stream.readline(200)
    parts = header.split()
    if len(parts) != 4 or b" ".join(parts[:2]) != MAGIC or not parts[2].isdigit():
        raise DagsyncError("what arrived is not a dagsync bundle (a dagsync of another version at the other end?)")
    size, expected = int(parts[2]), parts[3].decode()
    digest, got = hashlib.sha256(), 0
    wire = _CountingReader(stream)
    fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with os.fdopen(fd, "wb") as out, zstandard.ZstdDecompressor().stream_reader(wire) as reader:
            for block in iter(lambda: reader.read(CHUNK), b""):
                digest.update(block)
                got += len(block)
                out.write(block)
                if progress is not None:
                    progress("receiving", got, size)
    except zstandard.ZstdError as exc:
        raise DagsyncError(f"the bundle arrived damaged ({exc}); nothing was merged - run it again") from None
    if got != size or digest.hexdigest() != expected:
        raise DagsyncError(
            f"the bundle arrived incomplete ({got:,} of {size:,} bytes; the connection was cut?); "
            "nothing was merged - run it again"
        )
    return len(header) + wire.n


class _ReadingProgress:
    """A file read for ``write_wire``, telling ``progress`` how far it is."""

    def __init__(self, f: IO[bytes], size: int, progress: Progress) -> None:
        self.f, self.size, self.progress, self.n = f, size, progress, 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.n += len(data)
        self.progress("sending", self.n, self.size)
        return data


class _CountingReader:
    def __init__(self, stream: IO[bytes]) -> None:
        self.stream, self.n = stream, 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.n += len(data)
        return data


class _Counting:
    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.n = out, 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.n += len(data)
        return len(data)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def scratch_beside(target: Path, prefix: str) -> Iterator[Path]:
    """A name for a new file in ``target``'s directory (the same file system), removed afterwards."""
    directory = target.parent if str(target.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".{target.name}.{prefix}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
