"""The dagsync command line: parse, call one library function, render its report.

With ``cli.machines`` (sync, push, pull, marks, bundle), the only package
that imports typer (and click, lazily, for the llm plugin). Every command
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
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import typer.core

from dagsync import __version__, home, render
from dagsync.blobs import DEFAULT_LEVEL, pack
from dagsync.canonicalise import canonicalise
from dagsync.errors import DagsyncError, MergeConflict
from dagsync.faults import one_line
from dagsync.gc import DEFAULT_GRACE, gc, parse_grace
from dagsync.helpformat import HelpLayout
from dagsync.merge import merge
from dagsync.stats import stats
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
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description:<28}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                transient=True, console=Console(stderr=True),  # stdout stays the report's, for pipes
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


# Between machines and files: sync, push, pull, marks, bundle (registered
# here, so that --help lists them in this order).
from dagsync.cli import machines  # noqa: E402, F401


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


# forget (registered here, so that --help lists it after gc).
from dagsync.cli import forgetting  # noqa: E402, F401


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
        typer.Option("--threshold", metavar="BYTES", help="Leave payloads shorter than this many bytes inline. Default: the file's, else 192.", show_default=False),
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
