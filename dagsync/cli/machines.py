"""The commands between machines and files: sync, push, pull, marks, bundle,
and the far ends of push and pull (receive, send), which ssh runs.

Part of the command line (the ``cli`` package), whose app, options and
helpers they use; ``cli`` imports this module where these commands belong
in ``--help``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from dagsync import render
from dagsync.bundle import make as make_bundle
from dagsync.bundle import marks_of
from dagsync.cli import (
    DbArgument, DryRunOption, FullOption, JsonOption, QuietOption, _emit, _Progress, _reported, command,
    database, default_database,
)  # fmt: skip
from dagsync.errors import DagsyncError
from dagsync.merge import merge
from dagsync.remote import Remote, Transport, parse, pull, push
from dagsync.wire import read_wire, scratch_beside, write_wire
from dagsync.remote import sync as sync_remote
from dagsync.sync import sync

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
        with _Progress() as progress:
            remote_report = sync_remote(
                local, far, Transport(rsh, remote_dagsync), dry_run=dry_run, labels=labels, progress=progress
            )
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
    it was; push again. On a terminal it shows each step. The marks the other
    side keeps afterwards are remembered here (~/.cache/dagsync), so the next
    push makes its bundle while ssh connects. For cron:

        0 * * * *  dagsync push --quiet server:.config/io.datasette.llm
    """
    if len(paths) > 2:
        raise typer.BadParameter("give [SOURCE] [USER@]HOST:PATH", param_hint="paths")
    far = _remote(paths[-1], "[USER@]HOST:PATH")
    source = database(Path(paths[0])) if len(paths) == 2 else default_database()
    with _Progress() as progress:
        report = push(source, far, Transport(rsh, remote_dagsync), dry_run=dry_run, label=label, progress=progress)
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
    with _Progress() as progress:
        report = pull(far, target, Transport(rsh, remote_dagsync), dry_run=dry_run, label=label, progress=progress)
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
    bundle on standard input, merged into DB, and its report, then (with --json)
    DB's marks now, a line each; nothing if no bundle comes."""
    target = database(db)
    sys.stdout.write(json.dumps(marks_of(target)) + "\n")
    sys.stdout.flush()
    if not sys.stdin.buffer.peek(1) if hasattr(sys.stdin.buffer, "peek") else False:
        return  # a dry run: nothing sent
    with scratch_beside(target, "dagsync-push") as landing:
        read_wire(sys.stdin.buffer, landing)
        report = merge(target, [landing])
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(report)))
        typer.echo(json.dumps(marks_of(target)))
    else:
        typer.echo(render.merge(report))


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
