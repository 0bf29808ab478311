"""Node's http2 module as an HBONE server in a pod (``interop/hbone_server.js``): an HTTP/2 stack
independent of ztunnel's own, standing in for a peer ztunnel, a waypoint (``reply``) or a
network gateway (``forward``). Shared by the interop, waypoint and double-HBONE tests."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ztunnel.core.identity import Identity
from ztunnel.identity.localca import LocalCA
from ztunnel.testing.hbone import TRUST_DOMAIN, write_cert_files
from ztunnel.testing.netns import Host, NsProcess

INTEROP = Path(__file__).parent / "interop"


def node_binary() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("these tests need Node.js (node) on PATH")
    return path


def start_server(
    where: Host, ca: LocalCA, service_account: str, certs: Path, **cfg: object
) -> NsProcess:
    """``hbone_server.js`` on ``where``:15008 with a certificate for ``service_account`` (namespace
    default) from ``ca``; ``cfg`` adds its options (``reply``, ``responseBaggage``, ``forward``).
    Returns once it printed READY; it prints one JSON line per stream event (:func:`event`)."""
    files = write_cert_files(
        ca.issue(Identity(TRUST_DOMAIN, "default", service_account)), certs, service_account
    )
    config = {
        "port": 15008,
        "cert": str(files.cert),
        "key": str(files.key),
        "ca": str(files.ca),
        "trustDomain": TRUST_DOMAIN,
        **cfg,
    }
    proc = where.popen(
        node_binary(),
        str(INTEROP / "hbone_server.js"),
        json.dumps(config),
        stderr=subprocess.STDOUT,
    )
    proc.wait_for_line("READY", timeout=15)
    return proc


def event(proc: NsProcess, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The next JSON event line from a node server that matches ``pred``."""
    while True:
        ev: dict[str, Any] = json.loads(proc.wait_for_line("{", timeout=10))
        if pred(ev):
            return ev
