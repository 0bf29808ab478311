"""Decoders that stand in for real peers' views of our JSON: istioctl's ``ztunnel-config``
(a hand-written schema of its Go structs in :mod:`tests.golden.istioctl_schema`, and a small Go
program, ``istioctl/main.go``, built from hand-written structs with the same names and types)."""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

ISTIOCTL_DIR = Path(__file__).parent / "istioctl"
SUBCOMMANDS = ("workload", "service", "policy", "certificate", "connections", "all")


@functools.cache
def istioctl_decoder() -> Path:
    """Build the Go stand-in for ``istioctl ztunnel-config -f`` once per process (Debian's
    golang-go, installed by scripts/install-deps.sh)."""
    out = Path(tempfile.mkdtemp(prefix="ztunnel-istioctl-")) / "decoder"
    cache = Path(tempfile.gettempdir()) / "ztunnel-py-gocache"
    env = {
        **os.environ,
        "GOCACHE": str(cache),
        "GOPATH": str(cache / "gopath"),
        "GOFLAGS": "-mod=mod",
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }
    subprocess.run(
        ["go", "build", "-o", str(out), "."], cwd=ISTIOCTL_DIR, env=env, check=True, timeout=300
    )
    return out


def istioctl(subcommand: str, dump_json: bytes) -> subprocess.CompletedProcess[str]:
    """``istioctl ztunnel-config <subcommand> -f -`` as our Go stand-in prints it."""
    return subprocess.run(
        [str(istioctl_decoder()), subcommand],
        input=dump_json.decode(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def table(text: str) -> list[list[str]]:
    """A tabwriter table's rows, split on runs of two or more spaces or alignment padding."""
    rows = []
    for line in text.splitlines():
        if line.strip():
            rows.append(line.split())
    return rows
