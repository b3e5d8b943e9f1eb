"""The dagsync command line: parse, call one library function, render its report.

The only module that imports typer (and click, lazily, for the llm plugin). Every command
takes ``--json`` and prints its report as JSON; errors the user can act on
(``DagsyncError``) print one line ``Error: ...`` to stderr and exit 1; usage
errors exit 2. Set ``DAGSYNC_RAISE_ERRORS=1`` to see the traceback of an
unexpected failure.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import typer.core

from dagsync import __version__, home, render
from dagsync.blobs import DEFAULT_LEVEL, pack
from dagsync.bundle import make as make_bundle
from dagsync.bundle import marks_of
from dagsync.canonicalise import canonicalise
from dagsync.errors import DagsyncError, MergeConflict
from dagsync.faults import one_line
from dagsync.gc import DEFAULT_GRACE, gc, parse_grace
from dagsync.helpformat import HelpLayout
from dagsync.merge import merge
from dagsync.remote import Remote, Transport, parse, pull, push, read_wire, scratch_beside, write_wire
from dagsync.remote import sync as sync_remote
from dagsync.stats import stats
from dagsync.sync import sync
from dagsync.unpack import unpack
from dagsync.verify import verify

SUMMARY = "Merge, deduplicate, pack and garbage-collect the SQLite logs of the llm CLI."

# typer's own click (vendored since typer 0.26) or click itself, before: the
# class its usage errors derive from, re-raised untouched for typer to report.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _Command(HelpLayout, typer.core.TyperCommand): ...


class _Group(HelpLayout, typer.core.TyperGroup): ...


app = typer.Typer(
    cls=_Group,
    help=SUMMARY,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
command = functools.partial(app.command, cls=_Command)


def run(args: list[str] | None = None, prog_name: str = "dagsync") -> None:
    """The command line, standalone: it exits with the command's status."""
    app(args=args, prog_name=prog_name)


def llm_command() -> Any:
    """``llm dagsync``: a command of llm's own click (imported only here, when
    llm asks) that hands every argument, unparsed, to ``run``. typer carries
    its own click (since 0.26), whose exits and usage errors llm's does not
    know; standalone, ``run`` prints and exits as ``dagsync`` does."""
    import click

    @click.command(
        name="dagsync", help=SUMMARY, add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    )  # fmt: skip
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def dagsync_command(args: tuple[str, ...]) -> None:
        run(list(args), prog_name="llm dagsync")

    return dagsync_command


DbArgument = Annotated[
    Optional[Path],
    typer.Argument(
        help="Database file, or an llm home directory. Default: llm's own, in "
        "$LLM_USER_PATH or llm's app directory (dag.db if present, else logs.db).",
        show_default=False,
        metavar="[DB]",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]
QuietOption = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print nothing on success (for cron); errors still print.")
]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Report what would be done; write nothing.")]
FullOption = Annotated[
    bool,
    typer.Option(
        "--full",
        help="Read every source whole, not only what lies beyond the marks TARGET keeps of it "
        "(the result is the same; this re-checks every row, and brings back rows deleted from TARGET by hand).",
    ),
]
RshOption = Annotated[
    str,
    typer.Option(
        "--rsh", "-e", metavar="COMMAND",
        help="The ssh command to reach the other machine with, as in rsync (for example 'ssh -p 2222 -i key'). "
        "Default: ssh.",
    ),
]
RemoteDagsyncOption = Annotated[
    str,
    typer.Option(
        "--remote-dagsync", metavar="COMMAND",
        help="The command that runs dagsync on the other machine (for example ~/.local/bin/dagsync). Default: dagsync.",
    ),
]


VacuumOption = Annotated[
    bool,
    typer.Option(
        "--vacuum",
        help="Give the freed space back to the file system afterwards (in short steps once the "
        "file is in incremental auto-vacuum mode; the first time, one full VACUUM switches it).",
    ),
]


def llm_directory() -> Path:
    """llm's user directory, found the way llm finds it."""
    user_path = os.environ.get("LLM_USER_PATH")
    return Path(user_path) if user_path else Path(typer.get_app_dir("io.datasette.llm"))


def default_database() -> Path:
    """llm's own database (``home.own_database``)."""
    return home.own_database(llm_directory())


def database(path: Path | None) -> Path:
    """The file a database argument names (``home.resolve``)."""
    return home.resolve(path, llm_directory)


def _grace(text: str) -> str:
    try:
        parse_grace(text)
    except DagsyncError as exc:
        raise typer.BadParameter(str(exc)) from None
    return text


def _reported(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command body, turning a DagsyncError into one line and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MergeConflict as exc:
            typer.echo(f"Error: {one_line(str(exc))}", err=True)
            for conflict in exc.conflicts[10:]:
                typer.echo(f"  also: {one_line(conflict)}", err=True)
            raise typer.Exit(1) from None
        except DagsyncError as exc:
            # One line, whatever SQLite's own message held (quick_check's has several).
            typer.echo(f"Error: {one_line(str(exc))}", err=True)
            raise typer.Exit(1) from None
        except (typer.Exit, typer.Abort, _ClickException):
            raise
        except Exception as exc:
            if os.environ.get("DAGSYNC_RAISE_ERRORS") == "1":
                raise
            typer.echo(
                f"Error: unexpected {type(exc).__name__}: {one_line(str(exc))} "
                "(set DAGSYNC_RAISE_ERRORS=1 to see where)",
                err=True,
            )
            raise typer.Exit(1) from None

    return wrapper


def _print_json(report: Any) -> None:
    typer.echo(json.dumps(dataclasses.asdict(report), indent=2))


class _Notices(logging.Handler):
    """What the library says while it works ("waiting for another program to
    finish writing X ..."), on stderr when it is a terminal, above the progress
    bar if one is shown; nothing otherwise (cron)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not sys.stderr.isatty():
            return
        bar = _Progress.shown.bar if _Progress.shown is not None else None
        if bar is not None:
            bar.console.print(self.format(record), markup=False, highlight=False)
        else:
            typer.echo(self.format(record), err=True)


def _listen() -> None:
    log = logging.getLogger("dagsync")
    if not any(isinstance(h, _Notices) for h in log.handlers):
        log.addHandler(_Notices())
        log.setLevel(logging.INFO)
        log.propagate = False


class _Progress:
    """A progress bar on stderr when it is a terminal; nothing otherwise (cron)."""

    shown: _Progress | None = None  # the one on screen, for _Notices

    def __init__(self) -> None:
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description:<28}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                transient=True,
            )  # fmt: skip
            self.task = self.bar.add_task("", total=None)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=phase, completed=done, total=max(total, 1))

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        _Progress.shown = self
        return self

    def __exit__(self, *exc: object) -> None:
        _Progress.shown = None
        if self.bar is not None:
            self.bar.stop()


def _emit(report: Any, as_json: bool, quiet: bool, render: Callable[[Any], str]) -> None:
    """JSON when asked, else the text report, unless --quiet silences a success
    (for cron): a dry run always prints what it would do, piped or not."""
    if as_json:
        _print_json(report)
    elif not quiet or getattr(report, "dry_run", False):
        typer.echo(render(report))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dagsync {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    """Merge, deduplicate, pack and garbage-collect the SQLite logs of the llm CLI."""
    _listen()


@command("stats", short_help="Show what a database holds, table by table.")
@_reported
def stats_command(db: DbArgument = None, as_json: JsonOption = False) -> None:
    """Show a database's format and size, its threads and turns (llm format) or
    conversations and calls (dag format), its messages, and rows per table.

    Read-only: safe on a read-only file and beside a running llm.
    """
    report = stats(database(db))
    _print_json(report) if as_json else typer.echo(render.stats(report))


@command("merge", short_help="Merge SOURCE databases into TARGET; safe to re-run.")
@_reported
def merge_command(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="TARGET, the database to merge into (created, 0600, if missing), then one or more "
            "SOURCE databases to merge from, which are only read. With one path, TARGET is llm's own "
            "database. Any of them may be an llm home directory.",
            show_default=False,
            metavar="[TARGET] SOURCE...",
        ),
    ],
    label: Annotated[
        Optional[str],
        typer.Option(
            "--label", metavar="NAME",
            help="What the names of forks call the sources' own branches. Default: each source's file name, "
            "or the llm home directory it is in (this machine's name for llm's own). A branch a file got "
            "from another by a merge keeps that file's name.",
            show_default=False,
        ),
    ] = None,
    full: FullOption = False,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Merge every SOURCE into TARGET: every table llm reads, nothing lost, safe to re-run.

    Messages already in TARGET under another id are mapped onto it; integer
    ids are renumbered; a conversation whose head moved on one side is
    fast-forwarded, and one both sides continued keeps the branch continued
    last and gains a fork for the other, named after the file that branch came
    from (--label); each call follows its branch. A key holding different content on the two sides
    stops the merge before anything is written. Sources are checked and
    opened read-only. A running llm may keep writing TARGET meanwhile.

        dagsync merge laptop.db            # into llm's own database
        dagsync merge server.db laptop.db desktop.db
    """
    target = database(paths[0]) if len(paths) > 1 else default_database()
    sources = [database(p) for p in (paths[1:] if len(paths) > 1 else paths)]
    with _Progress() as progress:
        report = merge(target, sources, dry_run=dry_run, progress=progress, label=label, full=full)
    _emit(report, as_json, quiet, render.merge)


@command("sync", short_help="Make two databases hold the same history.")
@_reported
def sync_command(
    a: Annotated[str, typer.Argument(help="A database; receives everything B has.", show_default=False, metavar="A")],
    b: Annotated[str, typer.Argument(help="A database; receives everything A has.", show_default=False, metavar="B")],
    label_a: Annotated[
        Optional[str],
        typer.Option(
            "--label-a", metavar="NAME",
            help="What the names of forks call A's branches. Default: A's file name, "
            "or the llm home directory it is in (this machine's name for llm's own).",
            show_default=False,
        ),
    ] = None,
    label_b: Annotated[
        Optional[str],
        typer.Option("--label-b", metavar="NAME", help="What the names of forks call B's branches. Default: as for A.", show_default=False),
    ] = None,
    full: FullOption = False,
    rsh: RshOption = "ssh",
    remote_dagsync: RemoteDagsyncOption = "dagsync",
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Make A and B both hold the union of their histories (merge B into A, then A into B).

    Either may be an llm home directory, or [USER@]HOST:PATH on another machine
    (then: pull, push, and pull again if the push forked a conversation there;
    see push). With --dry-run, the second part shows what A holds that B
    lacks, before the first part has added B's forks to A.
    """
    far_a, far_b = parse(str(a)), parse(str(b))
    if far_a and far_b:
        raise typer.BadParameter("at most one of A and B may be on another machine", param_hint="A B")
    if far_a or far_b:
        # One side over ssh: pull, push, and pull what the push forked there.
        local, far, labels = (database(Path(b)), far_a, (label_b, label_a)) if far_a else (database(Path(a)), far_b, (label_a, label_b))
        assert far is not None
        remote_report = sync_remote(local, far, Transport(rsh, remote_dagsync), dry_run=dry_run, labels=labels)
        _emit(remote_report, as_json, quiet, render.remote_sync)
        return
    with _Progress() as progress:
        report = sync(database(Path(a)), database(Path(b)), dry_run=dry_run, progress=progress, labels=(label_a, label_b), full=full)
    _emit(report, as_json, quiet, render.sync)


def _remote(spec: str, role: str) -> Remote:
    found = parse(spec)
    if found is None:
        raise typer.BadParameter(f"{spec} is not [USER@]HOST:PATH", param_hint=role)
    return found


@command("push", short_help="Merge SOURCE into a database on another machine, over ssh.")
@_reported
def push_command(
    paths: Annotated[
        list[str],
        typer.Argument(
            help="SOURCE, the database to send from (default: llm's own), then [USER@]HOST:PATH, the database "
            "on the other machine to merge into (created there, 0600, if missing; may be an llm home directory).",
            show_default=False, metavar="[SOURCE] [USER@]HOST:PATH",
        ),
    ],
    rsh: RshOption = "ssh",
    remote_dagsync: RemoteDagsyncOption = "dagsync",
    label: Annotated[
        Optional[str],
        typer.Option("--label", metavar="NAME", help="What fork names there call SOURCE's branches (merge --label).", show_default=False),
    ] = None,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Bring a database on another machine up to date with SOURCE, over ssh.

    One ssh session asks the other machine for the marks its database keeps
    of SOURCE; the rows beyond them (a bundle) stream there compressed, and
    dagsync there merges them, with every guarantee of merge. dagsync must be
    installed on both machines. A cut connection leaves the database there as
    it was; push again. For cron:

        0 * * * *  dagsync push --quiet server:.config/io.datasette.llm
    """
    if len(paths) > 2:
        raise typer.BadParameter("give [SOURCE] [USER@]HOST:PATH", param_hint="paths")
    far = _remote(paths[-1], "[USER@]HOST:PATH")
    source = database(Path(paths[0])) if len(paths) == 2 else default_database()
    report = push(source, far, Transport(rsh, remote_dagsync), dry_run=dry_run, label=label)
    _emit(report, as_json, quiet, render.transfer)


@command("pull", short_help="Merge a database on another machine into TARGET, over ssh.")
@_reported
def pull_command(
    paths: Annotated[
        list[str],
        typer.Argument(
            help="[USER@]HOST:PATH, the database on the other machine to fetch from, then TARGET, the database "
            "to merge into (default: llm's own; created, 0600, if missing).",
            show_default=False, metavar="[USER@]HOST:PATH [TARGET]",
        ),
    ],
    rsh: RshOption = "ssh",
    remote_dagsync: RemoteDagsyncOption = "dagsync",
    label: Annotated[
        Optional[str],
        typer.Option("--label", metavar="NAME", help="What fork names here call the other machine's branches.", show_default=False),
    ] = None,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Bring TARGET up to date with a database on another machine, over ssh.

    The marks TARGET keeps of that database go there; the rows beyond them (a
    bundle) come back compressed and are merged here, with every guarantee of
    merge. dagsync must be installed on both machines.
    """
    if len(paths) > 2:
        raise typer.BadParameter("give [USER@]HOST:PATH [TARGET]", param_hint="paths")
    far = _remote(paths[0], "[USER@]HOST:PATH")
    target = database(Path(paths[1])) if len(paths) == 2 else default_database()
    with _Progress():
        report = pull(far, target, Transport(rsh, remote_dagsync), dry_run=dry_run, label=label)
    _emit(report, as_json, quiet, render.transfer)


@command("marks", short_help="Show how far DB has merged each source.")
@_reported
def marks_command(db: DbArgument = None, as_json: JsonOption = False) -> None:
    """Show the marks DB keeps of each source it has merged: how far, by table.

    A later merge of that source reads only what lies beyond them. The JSON
    is what `dagsync bundle --marks` reads, to make a bundle for DB elsewhere.
    Read-only; a DB that does not exist yet has no marks.
    """
    doc = marks_of(database(db))
    typer.echo(json.dumps(doc, indent=2)) if as_json else typer.echo(render.marks(doc))


@command("bundle", short_help="Write what SOURCE has beyond a target's marks to a file.")
@_reported
def bundle_command(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="SOURCE (default: llm's own database), then OUT, the bundle to write (a new file, 0600).",
            show_default=False, metavar="[SOURCE] OUT",
        ),
    ],
    marks_file: Annotated[
        Optional[Path],
        typer.Option(
            "--marks", metavar="FILE",
            help="The target's marks: what `dagsync marks --json TARGET` printed on the other machine "
            "(- for standard input). Without it, the bundle holds the whole source.",
            show_default=False,
        ),
    ] = None,
    all_pointers: Annotated[
        bool, typer.Option("--all-pointers", help="Carry every thread tip and conversation head, moved or not.")
    ] = False,
    label: Annotated[
        Optional[str],
        typer.Option("--label", metavar="NAME", help="What fork names call SOURCE's branches (merge --label).", show_default=False),
    ] = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Write a bundle: the rows of SOURCE beyond the marks a target keeps of it, for
    machines with no ssh between them (a USB stick).

        dagsync marks --json server.db > marks.json        # on the server
        dagsync bundle laptop.db b.db --marks marks.json   # on the laptop
        dagsync merge server.db b.db                       # on the server

    The bundle is an ordinary SQLite file of SOURCE's format. Merging it into
    another target than the one whose marks it was made against, or after
    that target lost rows, is refused whole, saying what to do.
    """
    if len(paths) > 2:
        raise typer.BadParameter("give [SOURCE] OUT", param_hint="paths")
    out = paths[-1]
    source = database(paths[0]) if len(paths) == 2 else default_database()
    doc = None
    if marks_file is not None:
        text = sys.stdin.read() if str(marks_file) == "-" else _read_text(marks_file)
        try:
            doc = json.loads(text)
        except ValueError:
            raise DagsyncError(f"{marks_file} is not the JSON `dagsync marks --json` prints") from None
    report = make_bundle(source, doc, out, label=label, all_pointers=all_pointers)
    _emit(report, as_json, quiet, render.bundle)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise DagsyncError(f"cannot read {path}: {exc.strerror}") from None


@command("receive", hidden=True)
@_reported
def receive_command(db: DbArgument = None, as_json: JsonOption = False) -> None:
    """The other end of push: DB's marks (one JSON line) on standard output, then a
    bundle on standard input, merged into DB, and its report; nothing if none comes."""
    target = database(db)
    sys.stdout.write(json.dumps(marks_of(target)) + "\n")
    sys.stdout.flush()
    if not sys.stdin.buffer.peek(1) if hasattr(sys.stdin.buffer, "peek") else False:
        return  # a dry run: nothing sent
    with scratch_beside(target, "dagsync-push") as landing:
        read_wire(sys.stdin.buffer, landing)
        report = merge(target, [landing])
    typer.echo(json.dumps(dataclasses.asdict(report))) if as_json else typer.echo(render.merge(report))


@command("send", hidden=True)
@_reported
def send_command(
    db: DbArgument = None,
    all_pointers: Annotated[bool, typer.Option("--all-pointers")] = False,
    label: Annotated[Optional[str], typer.Option("--label")] = None,
) -> None:
    """The other end of pull: the puller's marks on standard input, a bundle of DB beyond them on standard output."""
    doc = json.loads(sys.stdin.read() or "null")
    with tempfile.TemporaryDirectory(prefix="dagsync-send-") as d:
        out = Path(d) / "bundle.db"
        make_bundle(database(db), doc, out, label=label, all_pointers=all_pointers)
        write_wire(out, sys.stdout.buffer)


@command("canonicalise", short_help="Collapse duplicate dag-format messages into one.")
@_reported
def canonicalise_command(
    db: DbArgument = None, dry_run: DryRunOption = False, as_json: JsonOption = False, quiet: QuietOption = False
) -> None:
    """Collapse dag-format messages that share (parent_id, content_hash) into the earliest one.

    For files made without the unique index on that pair. Every reference
    moves to the surviving row and the old ids are recorded, then the unique
    index is created. Alias: canonicalize.
    """
    _emit(canonicalise(database(db), dry_run=dry_run), as_json, quiet, render.canonicalise)


command("canonicalize", hidden=True)(canonicalise_command)  # the alias


@command("verify", short_help="Check a database: integrity, hashes, references.")
@_reported
def verify_command(db: DbArgument = None, as_json: JsonOption = False) -> None:
    """Check a database without writing to it: integrity, foreign keys, dangling
    parents, cycles, every message re-hashed from its stored rows, duplicates.

    Exits 1 when any problem is found. Works on a read-only file.
    """
    report = verify(database(db))
    if as_json:
        _print_json(report)
    else:
        typer.echo(render.verify(report))
    if not report.ok:
        raise typer.Exit(1)


@command("gc", short_help="Delete what no thread or conversation reaches any more.")
@_reported
def gc_command(
    db: DbArgument = None,
    grace: Annotated[
        str,
        typer.Option(
            "--grace",
            metavar="DURATION",
            callback=_grace,
            help="Keep unreachable rows younger than this (0s, 30m, 12h, 14d, 2w ...): a running llm may "
            f"be about to point at them. Default: {DEFAULT_GRACE}.",
        ),
    ] = DEFAULT_GRACE,
    dry_run: DryRunOption = False,
    vacuum: VacuumOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Delete messages no conversation, call, thread or turn reaches, and what only they used.

    Roots are conversation heads and call heads (dag format), thread tips and
    turns' parent and tip messages (llm format); everything they reach
    through parent links is kept, and so is every unreachable message inside
    the grace period, with what it reaches. Then parts of deleted messages
    go, and fragments, attachments, tools and tool instances nothing
    references any more. Safe beside a running llm, and from cron:

        0 3 * * *  dagsync gc --quiet

    --grace 0s keeps nothing unreachable: use it only while no llm is writing.
    """
    seconds = parse_grace(grace)
    with _Progress() as progress:
        report = gc(database(db), grace=seconds, dry_run=dry_run, vacuum=vacuum, progress=progress)
    _emit(report, as_json, quiet, render.gc)


@command("pack", short_help="Compress payloads into a blob table (llm cannot read it).")
@_reported
def pack_command(
    db: DbArgument = None,
    dictionary: Annotated[
        bool,
        typer.Option("--dict", help="Train a zstd dictionary on the file's own small payloads and use it for them."),
    ] = False,
    level: Annotated[
        Optional[int],
        typer.Option("--level", metavar="N", help=f"zstd level, 1 (fastest) to 22 (smallest). Default: the file's, else {DEFAULT_LEVEL}.", show_default=False),
    ] = None,
    threshold: Annotated[
        Optional[int],
        typer.Option("--threshold", metavar="BYTES", help="Leave payloads shorter than this many bytes inline. Default: the file's, else 256.", show_default=False),
    ] = None,
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output", "-o", metavar="FILE",
            help="Pack a consistent copy of DB into the new file FILE (0600), and leave DB as it is.",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Pack llm's own database in place even so: llm fails on it until `dagsync unpack`."),
    ] = False,
    dry_run: DryRunOption = False,
    vacuum: VacuumOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Store each part payload once, zstd-compressed, in a content-addressed blob table.

    Moves message parts' text and JSON (and, in the llm format, fragments and
    attachments) into the blob store, leaving a reference in the row. Packing
    again packs only new rows. Every dagsync command reads packed files; llm
    does not: run `dagsync unpack` before using the file with llm again. So
    llm's own database is packed in place only with --force; --output packs
    a copy and leaves it as it is:

        dagsync pack --output archive.db --dict --vacuum
    """
    path = database(db)
    if output is None and not force and not dry_run and home.is_own(path, llm_directory()):
        raise DagsyncError(
            f"{path} is llm's own database, and llm cannot read a packed file until `dagsync unpack`; "
            f"pack a copy with `--output FILE`, or pass --force to pack it in place"
        )
    with _Progress() as progress:
        report = pack(
            path, dictionary=dictionary, level=level, threshold=threshold,
            dry_run=dry_run, vacuum=vacuum, progress=progress, output=output,
        )  # fmt: skip
    _emit(report, as_json, quiet, render.pack)


@command("unpack", short_help="Put packed payloads back in their rows, for llm.")
@_reported
def unpack_command(
    db: DbArgument = None,
    dry_run: DryRunOption = False,
    vacuum: VacuumOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Put every packed payload back in its row, byte for byte, and remove the blob store.

    Afterwards llm reads the file again.
    """
    with _Progress() as progress:
        report = unpack(database(db), dry_run=dry_run, vacuum=vacuum, progress=progress)
    _emit(report, as_json, quiet, render.unpack)


def main() -> None:
    run()
