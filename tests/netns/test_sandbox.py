"""The README's main job, run as a user runs it: ``python -m ztunnel.testing.sandbox`` builds the
two-node mesh, sends its traffic and tears everything down; every exchange must get its reply
and every hop must be in ztunnel's access log."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ztunnel.testing.netns import list_netns

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root"), pytest.mark.timeout(120)]


def test_sandbox_runs_end_to_end() -> None:
    before = set(list_netns())
    proc = subprocess.run(
        [sys.executable, "-m", "ztunnel.testing.sandbox"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr)
    exchanges = [ln for ln in out.splitlines() if "app saw client" in ln]
    assert len(exchanges) >= 6, out
    assert all("reply='hello from the sandbox'" in ln for ln in exchanges), out
    # through the waypoint: the echo app sees the waypoint as its client ...
    via = next(ln for ln in exchanges if "via its waypoint" in ln)
    assert "app saw client 10.2.0.3" in via, via
    # ... and both ztunnels logged the sandwich: sleep -> waypoint (authority: the VIP), then
    # waypoint -> echo.
    assert "hbone=10.96.0.11:80 service=reviews.default.svc.cluster.local" in out, out
    assert "sa/sleep dst.identity=spiffe://cluster.local/ns/default/sa/waypoint" in out, out
    assert "src.identity=spiffe://cluster.local/ns/default/sa/waypoint dst.identity" in out, out
    assert "ztunnel exit codes: {'node1': 0, 'node2': 0}" in out, out
    # nothing left behind (other beds, even other sandboxes, may come and go meanwhile: look
    # for this sandbox's own namespaces, by its bed's tag)
    (bed,) = [ln.split()[-1] for ln in out.splitlines() if ln.startswith("test bed ztb")]
    assert not {n for n in set(list_netns()) - before if n.startswith(bed + "-")}
