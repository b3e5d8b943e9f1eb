"""push, pull and sync over ssh: the system's OpenSSH client runs dagsync on
the other machine, as git and rsync do. No protocol of our own beyond a
stream: a bundle (``dagsync.bundle``), compressed.

* ``push SOURCE HOST:PATH``: one ssh session runs ``dagsync receive PATH``
  there, which first says the marks its target keeps (one JSON line); the
  bundle of what lies beyond them is made here and streams back on the same
  session, is merged there, and the report comes back, with the marks the
  target keeps now. Those are remembered here (``MarksCache``): the next
  push makes its bundle against them while ssh connects, and uses it if
  the marks the far side then says are the same.
* ``pull HOST:PATH TARGET``: one ssh session takes this target's marks on its
  input (``dagsync send PATH``) and streams back the bundle, merged here.

On the wire (``dagsync.wire``) a bundle is one header line, ``DAGSYNC-BUNDLE 1 <bytes>
<sha256>``, then the file in one zstd frame. The receiving side writes it to a
new file (0600) beside the target and merges it only once its size and hash
are right, so a connection cut at any byte leaves the target as it was (or,
cut during the merge, consistent: the merge is crash-safe), and the next push
completes it. A bundle leaving out a pointer row its source moved in place is
refused by the target; push and pull then send one with every pointer row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from dagsync import bundle
from dagsync.errors import DagsyncError
from dagsync.merge import merge
from dagsync.wire import read_wire, scratch_beside, write_wire
from dagsync.writer import Progress

__all__ = ["MarksCache", "Remote", "RemoteSyncReport", "Transport", "TransferReport", "parse", "pull", "push", "sync"]

# What the remote's refusal of a bundle that left out moved pointers says (bundle.received).
LEFT_OUT = "make the bundle again with --all-pointers"


@dataclass(frozen=True)
class Remote:
    host: str  # [USER@]HOST
    path: str

    def __str__(self) -> str:
        return f"{self.host}:{self.path}"


def parse(spec: str | os.PathLike[str]) -> Remote | None:
    """``[USER@]HOST:PATH`` as rsync reads it (a colon before any slash), else None: a local path."""
    text = str(spec)
    match = re.fullmatch(r"([^:/\s]+):(.*)", text)
    if match is None or Path(text).exists():
        return None
    if not match.group(2):
        raise DagsyncError(f"{text} names no file on {match.group(1)}; give HOST:PATH")
    return Remote(match.group(1), match.group(2))


@dataclass(frozen=True)
class Transport:
    """How to reach the other machine: ``rsh``, the ssh command (``-e`` as in
    rsync: ``ssh -p 2222``), and ``remote_dagsync``, the command that runs
    dagsync there (a shell word or words, as rsync's ``--rsync-path``)."""

    rsh: str = "ssh"
    remote_dagsync: str = "dagsync"

    def command(self, remote: Remote, *args: str) -> list[str]:
        words = shlex.split(self.rsh)
        if not words:
            raise DagsyncError("--rsh is empty; give the ssh command, for example 'ssh -p 2222'")
        line = " ".join([self.remote_dagsync, *(shlex.quote(a) for a in args)])
        return [*words, "-o", "BatchMode=yes", remote.host, line]

    def failure(self, remote: Remote, status: int, stderr: bytes) -> DagsyncError:
        """One line for what went wrong on the way to, or on, the other machine."""
        lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit status {status}"
        said = next((line.removeprefix("Error: ").strip() for line in lines if line.startswith("Error: ")), None)
        if status == 255:
            return DagsyncError(f"ssh to {remote.host} failed: {last}; nothing was written")
        if status == 127 or "command not found" in last or "No such file or directory" in last and not said:
            return DagsyncError(
                f"{remote.host} has no {self.remote_dagsync!r} to run (dagsync is not installed there, or not on "
                "the PATH ssh gives it): install dagsync there, or name it with --remote-dagsync"
            )
        if status == 2 and ("No such command" in last or "no such option" in last.lower()):
            return DagsyncError(
                f"the dagsync on {remote.host} is too old for push and pull ({last}); upgrade it there"
            )
        if said is not None:
            return DagsyncError(f"on {remote.host}: {said}")
        return DagsyncError(f"dagsync on {remote.host} failed: {last}")

    def json(self, remote: Remote, *args: str, stdin: bytes = b"") -> dict:
        """Run dagsync there and read the JSON it prints."""
        done = subprocess.run(self.command(remote, *args), input=stdin, capture_output=True)
        if done.returncode != 0:
            raise self.failure(remote, done.returncode, done.stderr)
        try:
            return json.loads(done.stdout)
        except ValueError:
            raise DagsyncError(
                f"dagsync on {remote.host} answered with something other than JSON; is {self.remote_dagsync!r} dagsync?"
            ) from None


# -- push and pull -------------------------------------------------------------------------


class MarksCache:
    """The marks each far target said it keeps of a source after the last push,
    one small file each (0600) under ``$XDG_CACHE_HOME/dagsync/marks``. Only a
    guess to start the next bundle with: a stale or missing one costs the time
    the guess would have saved, never a wrong bundle (push compares it with
    what the far side says first). Unwritable: nothing is remembered."""

    def __init__(self, remote: Remote, source: Path) -> None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dagsync" / "marks"
        name = hashlib.sha256(f"{remote}\0{source.resolve()}".encode()).hexdigest()[:32]
        self.path = base / f"{name}.json"

    def read(self) -> dict | None:
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def write(self, held: dict) -> None:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")  # two pushes at once each write their own
            fd = os.open(scratch, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(held, f)
            os.replace(scratch, self.path)


class _Guess:
    """A bundle made on a thread against marks guessed from the last push, while
    ssh connects and the far side reads its own."""

    def __init__(self, source: Path, held: dict, out: Path, label: str | None) -> None:
        self.held, self.out = held, out
        self.made: bundle.BundleReport | None = None
        self.thread = threading.Thread(target=self._make, args=(source, label), daemon=True)
        self.thread.start()

    def _make(self, source: Path, label: str | None) -> None:
        with contextlib.suppress(Exception):  # a failed guess is made again, and fails there if it must
            self.made = bundle.make(source, self.held, self.out, label=label)

    def take(self, held: dict) -> bundle.BundleReport | None:
        """The bundle, if it was made against ``held``; else None (and its file is gone)."""
        self.thread.join()
        if self.made is not None and self.held == held:
            return self.made
        self.out.unlink(missing_ok=True)
        return None


@dataclass(frozen=True)
class TransferReport:
    """What a push or a pull sent and what the receiving side merged."""

    direction: str  # "push" or "pull"
    source: str
    target: str
    dry_run: bool
    rows: dict[str, int]  # rows per table in the bundle
    bundle_bytes: int  # the bundle file
    sent_bytes: int  # on the wire, compressed
    against: str | None  # the marks the bundle was made against (the path recorded there); None: the whole source
    why_whole: str | None
    all_pointers: bool  # sent again with every pointer row (the target refused the first)
    merged: dict[str, Any] | None  # the receiving merge's report
    seconds: float
    # push: the bundle was made while ssh connected, against the marks the far
    # side kept after the last push (MarksCache), which it still keeps
    guessed: bool = False

    @property
    def written(self) -> int:
        if not self.merged:
            return 0
        return sum(t["added"] + t["updated"] + t["forked"] + t["moved"] for s in self.merged["sources"] for t in s["tables"])


def push(
    source: str | os.PathLike[str],
    remote: Remote,
    transport: Transport,
    *,
    dry_run: bool = False,
    label: str | None = None,
    progress: Progress | None = None,
) -> TransferReport:
    """Bring ``remote`` up to date with ``source``, in one ssh session: the far
    side (``dagsync receive``) says its marks, the bundle of what lies beyond
    them goes there and is merged, and its report comes back. ``progress``
    hears each step (the far side's merge only as a whole)."""
    started = time.perf_counter()
    cache = MarksCache(remote, Path(source))
    with tempfile.TemporaryDirectory(prefix="dagsync-push-") as d:
        retry = Retry()
        while True:
            guessed = None if retry.again else cache.read()
            guess = _Guess(Path(source), guessed, Path(d) / "guess.db", label) if guessed is not None else None
            try:
                status, stdout, stderr, made, sent = _push_once(
                    source, remote, transport, Path(d), guess, retry, dry_run, label, progress
                )
            finally:
                if guess is not None:
                    guess.thread.join()
            if status == 0:
                lines = stdout.splitlines()
                merged = json.loads(lines[0]) if lines else None
                if len(lines) > 1:
                    cache.write(json.loads(lines[1]))  # the marks there now: the next push's guess
                guessed = guess is not None and made is guess.made
                return _report("push", source, remote, dry_run, made, sent, retry.all_pointers, merged, started, guessed)
            failure = transport.failure(remote, status, stderr)
            if not retry.after(failure):
                raise failure


class Retry:
    """How a push or pull sends its bundle again when the receiving side refuses it
    for what it left out: with every pointer row (``LEFT_OUT``), or the whole
    source (``bundle.WHOLE_AGAIN``: the target forgot rows the new ones refer to).
    Each once."""

    def __init__(self) -> None:
        self.all_pointers = False
        self.whole_because: str | None = None

    @property
    def again(self) -> bool:
        return self.all_pointers or self.whole_because is not None

    def after(self, failure: Exception) -> bool:
        """Whether to send again after ``failure``; if so, how is set."""
        text = str(failure)
        if bundle.WHOLE_AGAIN in text and self.whole_because is None:
            self.whole_because = "the target forgot rows that new ones refer to"
            return True
        if LEFT_OUT in text and not self.again:
            self.all_pointers = True
            return True
        return False

    def marks(self, held: dict) -> dict:
        """The marks to make the bundle against."""
        return {**held, "whole_because": self.whole_because} if self.whole_because else held


def _push_once(
    source: str | os.PathLike[str], remote: Remote, transport: Transport, scratch: Path, guess: _Guess | None,
    retry: Retry, dry_run: bool, label: str | None, progress: Progress | None,
) -> tuple[int, bytes, bytes, bundle.BundleReport, int]:  # fmt: skip
    """One session of a push: the far side's marks, the bundle made against them
    (or the guess, if it was), sent; the far side's exit status, output and errors,
    the bundle, and the bytes sent."""
    say = progress or _silent
    say(f"asking {remote.host} for marks", 0, 0)
    proc = subprocess.Popen(
        transport.command(remote, "receive", "--json", remote.path),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        held = json.loads(proc.stdout.readline() or b"null")
    except ValueError:
        held = None
    if not isinstance(held, dict):
        proc.stdin.close()
        proc.wait()
        raise transport.failure(remote, proc.returncode or 1, proc.stderr.read())
    say("making the bundle", 0, 0)
    try:
        made = guess.take(held) if guess is not None else None
        out = guess.out if made is not None and guess is not None else scratch / "bundle.db"
        if made is None:
            out.unlink(missing_ok=True)  # an earlier try's
            made = bundle.make(source, retry.marks(held), out, label=label, all_pointers=retry.all_pointers)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    sent = 0
    try:
        if dry_run:
            with open(os.devnull, "wb") as nowhere:
                sent = write_wire(out, nowhere)
        else:
            sent = write_wire(out, proc.stdin, progress)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    if not dry_run:
        say(f"merging on {remote.host}", 0, 0)
    stdout, stderr = proc.stdout.read(), proc.stderr.read()  # a report and an error line at most
    out.unlink(missing_ok=True)
    return proc.wait(), stdout, stderr, made, sent


def pull(
    remote: Remote,
    target: str | os.PathLike[str],
    transport: Transport,
    *,
    dry_run: bool = False,
    label: str | None = None,
    progress: Progress | None = None,
) -> TransferReport:
    """Bring ``target`` up to date with ``remote``: the bundle of what lies beyond
    this target's marks, made there, merged here. ``progress`` hears each step."""
    started = time.perf_counter()
    say = progress or _silent
    target = Path(target)
    held = bundle.marks_of(target) if target.exists() and target.stat().st_size else {"sources": [], "exists": False}
    with scratch_beside(target, "dagsync-pull") as landing:
        retry = Retry()
        while True:
            args = ["send", remote.path] + (["--all-pointers"] if retry.all_pointers else [])
            if label:
                args += ["--label", label]
            proc = subprocess.Popen(
                transport.command(remote, *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            proc.stdin.write(json.dumps(retry.marks(held)).encode())
            proc.stdin.close()
            landing.unlink(missing_ok=True)
            say(f"{remote.host} makes the bundle", 0, 0)
            try:
                got = read_wire(proc.stdout, landing, progress)
            except DagsyncError as exc:
                status = proc.wait()
                stderr = proc.stderr.read()
                if status != 0:
                    raise transport.failure(remote, status, stderr) from None
                raise exc
            status = proc.wait()
            if status != 0:
                raise transport.failure(remote, status, proc.stderr.read())
            made = _made(landing, landing.stat().st_size)
            try:
                report = merge(target, [landing], dry_run=dry_run, progress=progress)
            except DagsyncError as exc:
                if retry.after(exc):
                    continue
                raise
            merged = json.loads(json.dumps(dataclasses.asdict(report)))
            return _report("pull", remote, target, dry_run, made, got, retry.all_pointers, merged, started)


def _silent(phase: str, done: int, total: int) -> None:
    pass


def _made(path: Path, size: int) -> bundle.BundleReport:
    """A received bundle described as ``bundle.make`` describes one it made."""
    import apsw

    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        found = bundle.meta(conn, "main") or {}
        rows = {t: n for t, n in found.get("rows", {}).items()}
    finally:
        conn.close()
    return bundle.BundleReport(
        str(path), found.get("source", ""), found.get("format", ""), found.get("identity", ""),
        found.get("against"), found.get("why_whole"), rows, size, 0.0,
    )  # fmt: skip


def _report(
    direction: str, source: object, target: object, dry_run: bool, made: bundle.BundleReport, sent: int,
    all_pointers: bool, merged: dict | None, started: float, guessed: bool = False,
) -> TransferReport:  # fmt: skip
    return TransferReport(
        direction, str(source), str(target), dry_run, made.rows, made.bytes, sent, made.against, made.why_whole,
        all_pointers, merged, round(time.perf_counter() - started, 3), guessed,
    )  # fmt: skip


@dataclass(frozen=True)
class RemoteSyncReport:
    """``sync LOCAL HOST:PATH``: pulled, pushed, and pulled once more when the push added forks there."""

    pulled: TransferReport
    pushed: TransferReport
    settle: TransferReport | None = None


def sync(
    local: str | os.PathLike[str],
    remote: Remote,
    transport: Transport,
    *,
    dry_run: bool = False,
    labels: tuple[str | None, str | None] = (None, None),
    progress: Progress | None = None,
) -> RemoteSyncReport:
    """Make ``local`` and ``remote`` hold the same history: pull, then push, then
    pull the fork rows the push added there (as ``dagsync.sync`` does for two files)."""
    label_local, label_remote = labels
    pulled = pull(remote, local, transport, dry_run=dry_run, label=label_remote, progress=progress)
    pushed = push(local, remote, transport, dry_run=dry_run, label=label_local, progress=progress)
    settle = None
    changed = pushed.merged and any(
        t["forked"] or t["moved"] for s in pushed.merged["sources"] for t in s["tables"]
    )
    if changed and not dry_run:
        settle = pull(remote, local, transport, label=label_remote, progress=progress)
    return RemoteSyncReport(pulled, pushed, settle)
