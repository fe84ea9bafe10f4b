"""The `distdoctor` command line: it parses arguments, calls the Python API and prints."""

from __future__ import annotations

import click

from distdoctor import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="distdoctor")
def main() -> None:
    """Find the bugs that make distributed PyTorch training silently wrong, slow or stuck."""


def _register_probe() -> None:
    # The probe command lives in its own module; importing it must not import torch.
    from distdoctor.cli_probe import probe

    main.add_command(probe)


try:
    _register_probe()
except ImportError:  # pragma: no cover - only while the probe module is being written
    pass
