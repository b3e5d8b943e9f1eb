"""What other processes are doing with a database file: having it open, opening it.

dagsync writes in short exclusive transactions so that a running llm, which
waits at most 5 s for a lock, never fails (see ``transactions``). Whether
another process holds the file's locks is ``locks``' question; here:

* ``may_be_waiting``: could another process be waiting for our lock? Only a
  process that has the file open can. If none has, the pause after each
  commit that lets a waiting llm in is time thrown away.

And one alarm: ``OpenAlarm`` calls back, from its own thread, the moment
another process opens the file, so that a long transaction taken while
nobody else had it open can step aside at once
(``transactions.long_transactions``).

inotify does not say who opened a file, and a merge's own helper threads
open its target to read it. They open it inside ``own_open``: an open the
watch hears while one of ours is under way counts only if the process
table then shows another process with the file open (``_open_elsewhere``).

Both read what the kernel knows (Linux: ``/proc/<pid>/fd``, inotify). Where
it cannot be read, the answer is the safe one: somebody may be waiting (so
the pause is kept).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct
import threading
from collections.abc import Callable, Iterator

__all__ = ["OpenAlarm", "may_be_waiting", "own_open"]


def may_be_waiting(path: str) -> bool:
    """Whether another process has had the file at ``path`` open since we first asked.

    The first question about a file looks through every process's open files
    (``/proc/<pid>/fd``) and starts an inotify watch for opens; later ones only
    read the watch's events. Once another process is seen, the answer stays
    yes for this file: being polite to nobody costs a few pauses, being rude
    to a waiting llm fails its prompt. A process this user may not inspect
    (another user's) is not seen while it was already open; one that opens
    the file later is.
    """
    return _WATCH.may_be_waiting(path)


@contextlib.contextmanager
def own_open(path: str) -> Iterator[None]:
    """Open ``path`` inside this block for this process's own use (a merge's
    helper thread reading its target): ``may_be_waiting`` does not take it
    for another process's. Only the open belongs inside.

    Not by counting opens: inotify merges identical events that are not yet
    read, so another process's open and ours can arrive as one, and SQLite
    may hand a new connection a kept descriptor without any open. Instead,
    what was heard before the block counts as before; an open heard while
    the block runs counts if the process table then shows another process
    with the file open - one that has closed it again is not waiting for
    our locks. (A process of another user is not seen there, so its open in
    that moment is missed; its next one is heard.) An ``OpenAlarm`` is not
    told: a merge's helpers open the target while it plans, outside any long
    transaction, and for an alarm a false ring costs only speed."""
    key = _WATCH.own_open_begins(path)
    try:
        yield
    finally:
        if key is not None:
            _WATCH.own_open_ends(key)


# From <sys/inotify.h>.
_IN_OPEN = 0x20
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


class _OpenWatch:
    """One inotify instance for the process, one watch per file asked about."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.unavailable = False
        self.files: dict[int, tuple[int, int]] = {}  # watch descriptor -> (st_dev, st_ino)
        self.watched: set[tuple[int, int]] = set()
        self.opened: set[tuple[int, int]] = set()  # files another process has had open
        # Watched files this process is opening itself (own_open), how many times at once.
        self.opening: dict[tuple[int, int], int] = {}
        self.lock = threading.Lock()  # own_open runs in helper threads

    def may_be_waiting(self, path: str) -> bool:
        with self.lock:
            return self._may_be_waiting(path)

    def own_open_begins(self, path: str) -> tuple[int, int] | None:
        """What was heard so far is read as it is; the file's key if it is watched."""
        with self.lock:
            try:
                st = os.stat(path)
            except OSError:
                return None
            key = (st.st_dev, st.st_ino)
            if self.fd is None or key not in self.watched:
                return None  # a watch begun later looks at the process table, which excludes us
            self.read_events()
            self.opening[key] = self.opening.get(key, 0) + 1
            return key

    def own_open_ends(self, key: tuple[int, int]) -> None:
        """Read what was heard while the open ran, then hear opens as another's again."""
        with self.lock:
            try:
                if self.fd is not None:
                    self.read_events()
            finally:
                self.opening[key] -= 1
                if not self.opening[key]:
                    del self.opening[key]

    def _may_be_waiting(self, path: str) -> bool:
        if not path or self.unavailable:
            return True
        try:
            st = os.stat(path)
        except OSError:
            return True
        key = (st.st_dev, st.st_ino)
        if self.fd is not None:
            self.read_events()  # first: a file gone since is forgotten now
        if key not in self.watched and not self.watch(path, key):
            return True
        return key in self.opened

    def watch(self, path: str, key: tuple[int, int]) -> bool:
        try:
            if self.fd is None:
                self.fd = _inotify_init()
            wd = _inotify_watch(self.fd, path)
        except (OSError, AttributeError):
            # Not Linux, or out of inotify instances or watches: always polite.
            self.unavailable = self.fd is None
            return False
        self.files[wd] = key
        self.watched.add(key)
        # Opened before the watch began: only the process table knows.
        if _open_elsewhere(key):
            self.opened.add(key)
        return True

    def read_events(self) -> None:
        assert self.fd is not None
        heard_while_opening: set[tuple[int, int]] = set()
        try:
            self._read_events(heard_while_opening)
        finally:
            for key in heard_while_opening - self.opened:
                # Ours, another's, or both as one event: who has the file open now?
                if key in self.watched and _open_elsewhere(key):
                    self.opened.add(key)

    def _read_events(self, heard_while_opening: set[tuple[int, int]]) -> None:
        assert self.fd is not None
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                self.opened.update(self.watched)
                return
            for wd, mask in _events(data):
                if mask & _IN_Q_OVERFLOW:
                    self.opened.update(self.watched)  # events were lost: assume the worst
                elif mask & _IN_IGNORED:
                    # The file is gone (or its watch removed): a new file with
                    # its inode number gets a new watch and a new look.
                    key = self.files.pop(wd, None)
                    if key is not None:
                        self.watched.discard(key)
                        self.opened.discard(key)
                elif mask & _IN_OPEN and wd in self.files:
                    key = self.files[wd]
                    if key in self.opening:
                        heard_while_opening.add(key)
                    else:
                        self.opened.add(key)


def _events(data: bytes) -> Iterator[tuple[int, int]]:
    """(watch descriptor, mask) of each inotify event read into ``data``."""
    offset = 0
    while offset + _EVENT.size <= len(data):
        wd, mask, _, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size + length
        yield wd, mask


def _inotify_init() -> int:
    """A new non-blocking inotify descriptor. :raises OSError, AttributeError: none to be had."""
    fd = ctypes.CDLL(None, use_errno=True).inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    return fd


def _inotify_watch(fd: int, path: str) -> int:
    """Watch ``path`` for opens on inotify descriptor ``fd``; the watch descriptor."""
    add_watch = ctypes.CDLL(None, use_errno=True).inotify_add_watch
    add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
    wd = add_watch(fd, os.fsencode(path), _IN_OPEN)
    if wd < 0:
        raise OSError(ctypes.get_errno(), "inotify_add_watch")
    return wd


class OpenAlarm:
    """Call ``on_open`` once, from a thread of its own, when a process opens ``path``.

    Any process, this one included: an open is a reason to be polite, and a
    false alarm costs only speed. ``OpenAlarm.start`` returns None where no
    alarm can be had (not Linux, no inotify left); then nobody can be told in
    time, and the caller must not take long transactions.
    """

    def __init__(self, fd: int, on_open: Callable[[], None]) -> None:
        self.fd = fd
        self.on_open = on_open
        self.stop_read, self.stop_write = os.pipe()
        self.thread = threading.Thread(target=self.wait, name="dagsync-open-alarm", daemon=True)
        try:
            self.thread.start()
        except RuntimeError:
            os.close(self.stop_read)
            os.close(self.stop_write)
            raise

    @classmethod
    def start(cls, path: str, on_open: Callable[[], None]) -> OpenAlarm | None:
        if not on_local_filesystem(path):
            return None  # inotify hears no open made on another host
        try:
            fd = _inotify_init()
        except (OSError, AttributeError):
            return None
        try:
            _inotify_watch(fd, path)
            return cls(fd, on_open)
        except (OSError, AttributeError, RuntimeError):
            os.close(fd)
            return None

    def wait(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self.stop_read, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self.stop_read in ready:
                return
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                self.on_open()  # the watch failed: assume the worst
                return
            for _, mask in _events(data):
                if mask & (_IN_OPEN | _IN_Q_OVERFLOW):
                    self.on_open()
                    return
                if mask & _IN_IGNORED:
                    return  # the file is gone: nobody can open it any more

    def close(self) -> None:
        os.write(self.stop_write, b"x")
        self.thread.join()
        for fd in (self.fd, self.stop_read, self.stop_write):
            os.close(fd)


# Filesystems whose files only this kernel opens, so that inotify hears every open.
LOCAL_FILESYSTEMS = frozenset(
    ("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "overlay", "zfs", "bcachefs", "jfs", "reiserfs")
)


def on_local_filesystem(path: str, mounts: str | None = None) -> bool:
    """Whether ``path`` is on a filesystem in LOCAL_FILESYSTEMS (read from
    ``/proc/mounts``, or ``mounts`` in its format). Not on NFS, SMB, FUSE, ...,
    where another host's opens are not heard; unknown counts as not."""
    try:
        if mounts is None:
            with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        where = os.path.realpath(path)
    except OSError:
        return False
    best, fstype = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts escapes spaces and the like as octal (\040).
        point = fields[1].encode().decode("unicode_escape")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype in LOCAL_FILESYSTEMS


def _open_elsewhere(key: tuple[int, int]) -> bool:
    """Whether a process other than this one has the file ``key`` (st_dev, st_ino) open."""
    me = os.getpid()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    except OSError:
        return True
    for pid in pids:
        try:
            fds = list(os.scandir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                if not os.readlink(fd.path).startswith("/"):
                    continue  # a pipe, socket, anonymous inode
                st = os.stat(fd.path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == key:
                return True
    return False


_WATCH = _OpenWatch()
