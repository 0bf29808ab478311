"""``ISTIO_META_ISTIO_VERSION`` reaches istiod as node metadata ``ISTIO_VERSION`` (istio/ztunnel
``src/config.rs`` keeps every ``ISTIO_META_*`` variable, prefix stripped, in ``proxy_metadata``;
``src/xds/client.rs`` ``node()`` sends it). Istio's ztunnel image sets the variable
(``pilot/docker/Dockerfile.ztunnel``), and so does ours, from the ``istio_version`` build arg."""

from __future__ import annotations

from pathlib import Path

import pytest

from ztunnel.admin.admin import build_info, istio_version_from_env
from ztunnel.config import Config
from ztunnel.xds.client import build_node

pytestmark = pytest.mark.timeout(10)


def test_istio_version_sent_in_node_metadata() -> None:
    env = {"ISTIO_META_ISTIO_VERSION": "1.28.1"}
    node = build_node(Config.from_env(env), env)
    assert node.metadata.fields["ISTIO_VERSION"].string_value == "1.28.1"


def test_istio_version_in_build_info_and_default() -> None:
    # Rust BuildInfo: istio_version from ISTIO_META_ISTIO_VERSION, else "unknown".
    assert istio_version_from_env({"ISTIO_META_ISTIO_VERSION": "1.28.1"}) == "1.28.1"
    assert istio_version_from_env({}) == "unknown"
    assert build_info("1.28.1")["istioVersion"] == "1.28.1"


def test_dockerfile_sets_it_from_the_build_arg() -> None:
    text = (Path(__file__).parents[3] / "Dockerfile").read_text()
    assert "ARG istio_version" in text
    assert "ISTIO_META_ISTIO_VERSION=$istio_version" in text
