"""The llm plugin: with dagsync installed beside llm, ``llm dagsync ...`` runs dagsync.

llm finds this module through the ``llm`` entry point in pyproject.toml and
calls ``register_commands``. llm's command line is built on click; dagsync's
on typer, which (since 0.26) carries its own copy of click, whose exits and
usage errors llm's click does not recognise. So llm gets a plain click
command that hands every argument, unparsed, to dagsync's own command line
in standalone mode: ``llm dagsync ...`` prints what ``dagsync ...`` prints
and exits with the same status (0, 1 for an error, 2 for a usage error). A
database argument left out still means llm's own database.
"""

import click
import llm

from dagsync.cli import SUMMARY, run


@llm.hookimpl
def register_commands(cli: click.Group) -> None:
    @cli.command(
        name="dagsync",
        help=SUMMARY,
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def dagsync_command(args: tuple[str, ...]) -> None:
        run(list(args), prog_name="llm dagsync")
