"""Helpers shared by the probe tests: find processes a test started, free ports, the CLI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid


def new_marker() -> str:
    """A unique value for DISTDOCTOR_TEST_MARKER: every process a test starts inherits it."""
    return f"dd-test-{uuid.uuid4().hex[:12]}"


def processes_with_marker(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds `marker`."""
    found = []
    needle = f"DISTDOCTOR_TEST_MARKER={marker}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != b"Z":
            found.append(int(name))
    return found


def wait_for_no_processes(marker: str, within_s: float = 5.0) -> list[int]:
    """The marked processes still alive after `within_s` seconds (empty when all are gone)."""
    deadline = time.monotonic() + within_s
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def marked_env(marker: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "DISTDOCTOR_TEST_MARKER": marker, **extra}


def run_cli(args: list[str], marker: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """`python -m distdoctor ARGS` in a subprocess, marked, bounded."""
    return subprocess.run([sys.executable, "-m", "distdoctor", *args], capture_output=True, text=True,
                          env=marked_env(marker), timeout=timeout)
