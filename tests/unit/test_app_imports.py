"""Memory at rest (issue 18): what building the app imports. The control-plane libraries and
dnspython are imported where used, so a ztunnel that has not needed them does not hold them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A fresh interpreter: the test process itself has imported everything.
_PROBE = r"""
import json, struct, sys
import ztunnel.app, ztunnel.cli, ztunnel.dns.server
from ztunnel.config import Config
from ztunnel.dns import wire

# no mesh config file, no PROXY_CONFIG: nothing for PyYAML to parse
Config.from_env({"PROXY_MODE": "shared"}, mesh_config="/nonexistent/mesh.yaml")

# a one-question A query, answered on the fast path as from state
query = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"\x07reviews\x03ns1\x00" + b"\x00\x01\x00\x01"
req = wire.parse(query)
assert isinstance(req, wire.Request) and req.message is None
wire.answer(req, [])
assert wire.type_text(req.qtype) == "a"
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""

LAZY = ("dns", "grpclib", "google", "yaml", "h2", "tracemalloc")


@pytest.mark.timeout(60)
def test_building_and_answering_from_state_imports_no_control_plane_library() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=50
    )
    loaded = set(json.loads(out.stdout))
    assert not loaded & set(LAZY), sorted(loaded & set(LAZY))
