"""ENABLE_ORIG_SRC=false: the app behind ztunnel sees ztunnel's address, not the client's
(Rust config require_original_source, proxy.rs maybe_set_transparent)."""

from __future__ import annotations

import pytest

from ztunnel.testing.apps import connect_from, recv_line, start_app
from ztunnel.testing.hbone import mesh

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root"), pytest.mark.timeout(60)]


def test_app_sees_ztunnel_address_without_orig_src() -> None:
    with mesh(extra_env={"ENABLE_ORIG_SRC": "false"}) as m:
        echo = start_app(m.b, "echo", "--announce", ports=(9020,))
        with connect_from(m.a, m.b.ip4, 9020) as s:
            peer = recv_line(s).split()
        # ztunnel-b runs in pod b's namespace: its upstream comes from b's own address.
        assert peer[1] != m.a.ip4
        assert peer[1] in (m.b.ip4, "127.0.0.1")
        echo.stop()
