"""The `distdoctor` command line: the click group. Each half of the product brings its commands:
`distdoctor.lint.cli` (lint, rules, explain), `distdoctor.probe.cli` (probe) and
`distdoctor.probe.stacks.cli` (stacks). A command's module is imported when that command runs (or
for `--help`), so `distdoctor lint` under pre-commit pays for none of the probe's imports."""

from __future__ import annotations

import importlib

import click

from distdoctor import __version__

# name -> (module, attribute), in the order `--help` lists them.
COMMANDS = {
    "lint": ("distdoctor.lint.cli", "lint"),
    "rules": ("distdoctor.lint.cli", "rules_command"),
    "explain": ("distdoctor.lint.cli", "explain"),
    "probe": ("distdoctor.probe.cli", "probe"),  # importing it must not import torch either
    "stacks": ("distdoctor.probe.stacks.cli", "stacks"),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute = COMMANDS[cmd_name]
        return getattr(importlib.import_module(module), attribute)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="distdoctor")
def main() -> None:
    """Find the bugs that make distributed PyTorch training silently wrong, slow or stuck.

    \b
      distdoctor lint train.py         static rules, no torch needed
      distdoctor probe --nproc 2       runtime checks of this machine, through torchrun
      distdoctor probe train.py        runtime checks of your own script
      distdoctor stacks                where a live, hung job's ranks parted
    """
