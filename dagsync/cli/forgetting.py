"""``dagsync forget``: the command line of dagsync/forget (see docs/forget.md)."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer

from dagsync import render
from dagsync.cli import DbArgument, DryRunOption, JsonOption, _emit, _Progress, _reported, command, database
from dagsync.forget import Selector, forget, parse_age, parse_date, restore

__all__ = ["forget_command"]


@command("forget", short_help="Delete conversations safely; shared prefixes stay.")
@_reported
def forget_command(
    db: DbArgument = None,
    ids: Annotated[
        Optional[list[str]],
        typer.Option("--id", metavar="ID", help="A conversation (thread) id, as `llm logs list` shows it. Repeatable."),
    ] = None,
    before: Annotated[
        Optional[str],
        typer.Option("--before", metavar="DATE", help="Conversations whose latest activity is before DATE (UTC)."),
    ] = None,
    older_than: Annotated[
        Optional[str],
        typer.Option("--older-than", metavar="AGE", help="Conversations whose latest activity is older than AGE (90d, 52w ...)."),
    ] = None,
    models: Annotated[
        Optional[list[str]],
        typer.Option("--model", "-m", metavar="MODEL", help="Conversations that used MODEL. Repeatable (any of them)."),
    ] = None,
    queries: Annotated[
        Optional[list[str]],
        typer.Option("--query", "-q", metavar="WORDS", help="Conversations llm's full-text index finds WORDS in (as `llm logs -q`). Repeatable."),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before deleting.")] = False,
    restore_ids: Annotated[
        Optional[list[str]],
        typer.Option("--restore", metavar="ID", help="Stop keeping conversation ID forgotten (then `merge --full` brings it back). Repeatable."),
    ] = None,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="Print nothing on success (for cron); errors still print.")] = False,
) -> None:
    """Delete the selected conversations and exactly what nothing else reaches any more.

    Selectors combine with AND. Their turns or calls go, with search rows,
    tool and fragment links; then messages, parts, fragments, attachments and
    blobs that only they used. A prefix another thread shares stays whole.
    The file keeps a tombstone for each one. Safe beside a running llm.

        dagsync forget --id 01j9... --dry-run

    A retention policy, from cron:

        0 4 * * *  dagsync forget --older-than 365d --yes --quiet
    """
    path = database(db)
    if restore_ids:
        _emit(restore(path, tuple(restore_ids), dry_run=dry_run), as_json, quiet, render.restore)
        return
    written = {
        k: v for k, v in {"id": ids, "before": before, "older_than": older_than, "model": models, "query": queries}.items() if v
    }
    now = time.time()
    cutoffs = [parse_date(before)] if before else []
    if older_than:
        cutoffs.append(parse_age(older_than, now))
    selector = Selector(
        ids=tuple(ids or ()), before=min(cutoffs) if cutoffs else None,
        models=tuple(models or ()), queries=tuple(queries or ()), written=written,
    )  # fmt: skip
    if not dry_run and not yes and not selector.empty:
        if not sys.stdin.isatty():
            raise typer.BadParameter("give --yes to delete without being asked (or --dry-run to see what would go)")
        preview = forget(path, selector, dry_run=True)
        typer.echo(render.forget(preview))
        if not preview.conversations:
            return
        typer.confirm(f"Forget these {len(preview.conversations):,} conversation(s)?", abort=True)
    with _Progress() as progress:
        report = forget(path, selector, dry_run=dry_run, progress=progress, now=now)
    _emit(report, as_json, quiet, render.forget)
