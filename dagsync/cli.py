"""The dagsync command line: parse, call one library function, render its report.

The only module that imports typer (and, through it, click). Every command
takes ``--json`` and prints its report as JSON; errors the user can act on
(``DagsyncError``) print one line ``Error: ...`` to stderr and exit 1; usage
errors exit 2. Set ``DAGSYNC_RAISE_ERRORS=1`` to see the traceback of an
unexpected failure.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer

from dagsync import __version__
from dagsync.errors import DagsyncError
from dagsync.stats import Stats, stats

app = typer.Typer(
    help="Merge, deduplicate, pack and garbage-collect the SQLite logs of the llm CLI.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DbArgument = Annotated[
    Optional[Path],
    typer.Argument(
        help="Database file. Default: llm's own, in $LLM_USER_PATH or llm's app "
        "directory (dag.db if present, else logs.db).",
        show_default=False,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]


def default_database() -> Path:
    """llm's own database, found the way llm finds its user directory.

    :raises DagsyncError: neither dag.db nor logs.db exists there.
    """
    user_path = os.environ.get("LLM_USER_PATH")
    directory = Path(user_path) if user_path else Path(click.get_app_dir("io.datasette.llm"))
    for name in ("dag.db", "logs.db"):
        if (directory / name).exists():
            return directory / name
    raise DagsyncError(
        f"no database given, and llm's directory {directory} has neither dag.db "
        "nor logs.db; pass the database file as an argument"
    )


def _reported(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command body, turning a DagsyncError into one line and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DagsyncError as exc:
            typer.echo(f"Error: {exc}", err=True)
            raise typer.Exit(1) from None
        except (typer.Exit, typer.Abort, click.ClickException):
            raise
        except Exception as exc:
            if os.environ.get("DAGSYNC_RAISE_ERRORS") == "1":
                raise
            typer.echo(
                f"Error: unexpected {type(exc).__name__}: {exc} "
                "(set DAGSYNC_RAISE_ERRORS=1 to see where)",
                err=True,
            )
            raise typer.Exit(1) from None

    return wrapper


def _print_json(report: Any) -> None:
    typer.echo(json.dumps(dataclasses.asdict(report), indent=2))


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _render_stats(s: Stats) -> str:
    width = max(len(name) for name in s.tables)
    lines = [
        f"{s.path}  ({s.format} format, {_human_bytes(s.file_bytes)})",
        f"  conversations  {s.conversations:>12,}",
        f"  messages       {s.messages:>12,}",
        f"  chains         {s.chains:>12,}   (chain ends: messages nothing continues)",
        f"  forks          {s.forks:>12,}   (messages continued in two or more ways)",
        f"  calls          {s.calls:>12,}",
        "  rows per table:",
        *(f"    {name:<{width}}  {rows:>12,}" for name, rows in s.tables.items()),
    ]
    return "\n".join(lines)


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


@app.command("stats")
@_reported
def stats_command(db: DbArgument = None, as_json: JsonOption = False) -> None:
    """Show a database's format, rows per table, conversations, chains, forks, calls and size.

    Read-only: safe on a read-only file and beside a running llm.
    """
    report = stats(db or default_database())
    _print_json(report) if as_json else typer.echo(_render_stats(report))


def main() -> None:
    app(prog_name="dagsync")
