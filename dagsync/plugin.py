"""The llm plugin: with dagsync installed beside llm, ``llm dagsync ...`` runs dagsync.

llm finds this module through the ``llm`` entry point in pyproject.toml and
calls ``register_commands`` with its click group; the command is
``cli.llm_command``, which prints and exits exactly as ``dagsync`` does. A
database argument left out still means llm's own database.
"""

import llm

from dagsync.cli import llm_command


@llm.hookimpl
def register_commands(cli) -> None:  # noqa: ANN001 - llm's click.Group
    cli.add_command(llm_command())
