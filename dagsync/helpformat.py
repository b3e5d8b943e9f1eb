"""How dagsync's help reads: like llm's and sqlite-utils'.

A mixin for the command line's command classes (``cli._Command``,
``cli._Group``, which add it to typer's): the usage line shows each
argument's own metavar (``TARGET SOURCE...``, ``[DB]``), and options show
their value's metavar (``--grace DURATION``) but none of the ``<bool>`` or
``<list[Path]>`` type tags typer adds. It uses only what every click
command has, so it needs no import of click or typer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HelpLayout"]


def _option_record(option: Any) -> tuple[str, str]:
    """``-q, --quiet`` or ``--grace DURATION``, and its help: click's own layout."""
    names = ", ".join(sorted(option.opts, key=len))
    if not option.is_flag:
        names += f" {option.metavar or option.name.upper()}"
    return names, option.help or ""


class HelpLayout:
    """Usage pieces and option records for a click command or group."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        pieces += [p.metavar or p.name.upper() for p in self.params if p.param_type_name == "argument"]
        if hasattr(self, "subcommand_metavar"):  # a group
            pieces.append(self.subcommand_metavar)
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        params = [p for p in self.get_params(ctx) if not p.hidden]
        arguments = [(p.metavar, p.help or "") for p in params if p.param_type_name == "argument"]
        options = [_option_record(p) for p in params if p.param_type_name == "option"]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        if hasattr(self, "format_commands"):  # a group lists its commands
            self.format_commands(ctx, formatter)
