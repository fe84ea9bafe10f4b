"""The `distdoctor` command line: the click group. Each half of the product brings its commands:
`distdoctor.lint.cli` (lint, rules, explain), `distdoctor.probe.cli` (probe) and
`distdoctor.probe.stacks.cli` (stacks)."""

from __future__ import annotations

import click

from distdoctor import __version__
from distdoctor.lint.cli import explain, lint, rules_command
from distdoctor.probe.cli import probe  # importing it must not import torch (the CLI starts fast)
from distdoctor.probe.stacks.cli import stacks


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="distdoctor")
def main() -> None:
    """Find the bugs that make distributed PyTorch training silently wrong, slow or stuck.

    \b
      distdoctor lint train.py         static rules, no torch needed
      distdoctor probe --nproc 2       runtime checks of this machine, through torchrun
      distdoctor probe train.py        runtime checks of your own script
      distdoctor stacks                where a live, hung job's ranks parted
    """


for command in (lint, rules_command, explain, probe, stacks):
    main.add_command(command)
