"""The llm plugin: with dagsync installed beside llm, ``llm dagsync ...`` runs dagsync.

llm finds this module through the ``llm`` entry point in pyproject.toml and
calls ``register_commands``; the commands are dagsync's own, so a database
argument left out still means llm's own database.
"""

import llm

from dagsync.cli import click_command


@llm.hookimpl
def register_commands(cli):
    cli.add_command(click_command(), name="dagsync")
