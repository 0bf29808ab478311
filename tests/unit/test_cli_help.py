"""``ztunnel help`` (Rust ``main.rs`` ``help()``: the commands and the version, exit 0)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ztunnel.cli import EXIT_FAILURE, EXIT_OK, main

pytestmark = pytest.mark.timeout(30)


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith('\nIstio Ztunnel (version.BuildInfo{Version:"')
    assert 'PythonVersion:"' in out and 'IstioVersion:"' in out
    for line in (
        "proxy (default) - Start the ztunnel proxy",
        "version         - Print the version of ztunnel",
        "help            - Print commands and version of ztunnel",
    ):
        assert line in out


def test_help_for_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help", "top"]) == EXIT_OK
    assert "--once" in capsys.readouterr().out
    assert main(["help", "nope"]) == EXIT_FAILURE
    assert "unknown command: nope" in capsys.readouterr().err


def test_help_as_a_process() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ztunnel", "help"], capture_output=True, text=True, timeout=20
    )
    assert r.returncode == 0 and "Commands:" in r.stdout, r.stderr
