"""Authorization explain: the query resolver (``ztunnel.admin.explain``) and the admin endpoint
``GET /debug/authz`` over a real loopback server."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from tests.unit.admin import request
from ztunnel.admin import AdminHandler, HttpServer
from ztunnel.admin.explain import UnknownWorkload, explain_query, find_workload
from ztunnel.core.addr import parse_ip
from ztunnel.state.authz import NO_ALLOW_POLICIES, NOT_ALLOWED, Explanation, PolicyIndex
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(30)

CONFIG = """
workloads:
- uid: cluster1//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  trustDomain: cluster.local
  workloadIps: ["10.1.0.2"]
  protocol: HBONE
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  trustDomain: cluster.local
  workloadIps: ["10.2.0.2", "fd00:2::2"]
  protocol: HBONE
  authorizationPolicies: ["default/allow-client"]
- uid: cluster1//v1/Pod/other/open
  name: open
  namespace: other
  trustDomain: cluster.local
  workloadIps: ["10.3.0.2"]
  protocol: HBONE
policies:
- name: allow-client
  namespace: default
  scope: WorkloadSelector
  action: Allow
  rules:
  - - - serviceAccounts: [{namespace: default, serviceAccount: client}]
- name: deny-9999
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - destinationPorts: [9999]
"""

CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
OTHER_ID = "spiffe://cluster.local/ns/default/sa/other"
SERVER_UID = "cluster1//v1/Pod/default/server"


@pytest.fixture
def state() -> State:
    st = State()
    load_local_config(CONFIG, "test.yaml").apply_to(st)
    return st


# --- the resolver ------------------------------------------------------------------------------


def test_find_workload_by_uid_name_and_ip(state: State) -> None:
    assert find_workload(state, SERVER_UID)[0].name == "server"
    assert find_workload(state, "default/server") == (find_workload(state, SERVER_UID)[0], None)
    w, ip = find_workload(state, "fd00:2::2")
    assert (w.name, ip) == ("server", parse_ip("fd00:2::2"))
    for bad in ("default/nope", "10.9.9.9", "server", "a/b/c"):
        with pytest.raises(UnknownWorkload):
            find_workload(state, bad)
    with pytest.raises(UnknownWorkload):
        find_workload(state, "10.2.0.2", network="elsewhere")


def test_allowed_by_the_selector_policy(state: State) -> None:
    ex = explain_query(state, {"src": CLIENT_ID, "dst": "default/server", "port": "8080"})
    assert ex.decision.allowed
    assert ex.decision.policy == "default/allow-client"
    assert ex.destination_uid == SERVER_UID
    assert ex.connection.dst_ip == parse_ip("10.2.0.2")
    assert [p.key for p in ex.policies] == ["default/deny-9999", "default/allow-client"]
    assert "source IP not given" in ex.notes[0]


def test_denied_other_identity_port_and_plaintext(state: State) -> None:
    ex = explain_query(state, {"src": OTHER_ID, "dst": SERVER_UID, "port": "8080"})
    assert (ex.decision.allowed, ex.decision.reason) == (False, NOT_ALLOWED)
    ex = explain_query(state, {"src": CLIENT_ID, "dst": SERVER_UID, "port": "9999"})
    assert not ex.decision.allowed
    assert ex.decision.reason == "explicitly denied by: default/deny-9999"
    # An IP is a plaintext client: no identity, so the service-account ALLOW cannot match.
    ex = explain_query(state, {"src": "10.1.0.2", "dst": "10.2.0.2", "port": "8080"})
    assert ex.connection.src_identity is None
    assert str(ex.connection.src_ip) == "10.1.0.2"
    assert (ex.decision.allowed, ex.decision.reason) == (False, NOT_ALLOWED)


def test_source_workload_and_source_ip(state: State) -> None:
    ex = explain_query(state, {"src": "default/client", "dst": SERVER_UID, "port": "80"})
    assert str(ex.connection.src_identity) == CLIENT_ID
    assert str(ex.connection.src_ip) == "10.1.0.2"
    assert ex.decision.allowed and not ex.notes
    ex = explain_query(
        state, {"src": CLIENT_ID, "src_ip": "10.7.7.7", "dst": SERVER_UID, "port": "80"}
    )
    assert str(ex.connection.src_ip) == "10.7.7.7"
    # Destination named by IP: that IP is the destination address.
    ex = explain_query(state, {"src": CLIENT_ID, "dst": "fd00:2::2", "port": "80"})
    assert str(ex.connection.dst_ip) == "fd00:2::2"


def test_no_policies_apply(state: State) -> None:
    ex = explain_query(state, {"dst": "other/open", "port": "1"})
    assert ex.policies == ()
    assert (ex.decision.allowed, ex.decision.reason) == (True, NO_ALLOW_POLICIES)


def test_uses_the_index_when_given(state: State) -> None:
    index = PolicyIndex.from_state(state)
    try:
        q = {"src": OTHER_ID, "dst": SERVER_UID, "port": "8080"}
        assert explain_query(state, q, policies=index).decision == explain_query(state, q).decision
    finally:
        index.close()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"port": "80"}, "dst is required"),
        ({"dst": SERVER_UID}, "port is required"),
        ({"dst": SERVER_UID, "port": "http"}, "invalid port"),
        ({"dst": SERVER_UID, "port": "70000"}, "out of range"),
        ({"dst": SERVER_UID, "port": "80", "src": "spiffe://x/y"}, "is not spiffe://"),
        ({"dst": SERVER_UID, "port": "80", "src_ip": "nope"}, "invalid IP address"),
        ({"dst": SERVER_UID, "port": "80", "sauce": "x"}, "unknown parameter(s) sauce"),
    ],
)
def test_bad_queries(state: State, params: Mapping[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        explain_query(state, params)


def test_unknown_source_workload(state: State) -> None:
    with pytest.raises(UnknownWorkload, match="default/ghost"):
        explain_query(state, {"src": "default/ghost", "dst": SERVER_UID, "port": "80"})


# --- the admin endpoint -------------------------------------------------------------------------


async def _serve(state: State, *, wired: bool = True) -> HttpServer:
    handler = AdminHandler(
        state=lambda: state,
        config=dict,
        explain=(lambda q: explain_query(state, q)) if wired else None,
    )
    srv = HttpServer.bind("admin", [("127.0.0.1", 0)], handler)
    await srv.start()
    return srv


@pytest.mark.both_loops
async def test_endpoint_json(state: State) -> None:
    srv = await _serve(state)
    try:
        target = f"/debug/authz?src={CLIENT_ID}&dst=default/server&port=9999"
        r = await request(srv.port, "GET", target)
        assert r.status == 200
        assert r.headers["content-type"] == "application/json"
        body = json.loads(r.body)
        expected = explain_query(state, {"src": CLIENT_ID, "dst": "default/server", "port": "9999"})
        assert body == expected.to_dict()
        assert body["decision"] == {
            "allowed": False,
            "policy": "default/deny-9999",
            "reason": "explicitly denied by: default/deny-9999",
        }
        assert body["source"]["identity"] == CLIENT_ID
        assert body["destination"]["uid"] == SERVER_UID
        assert [p["policy"] for p in body["policies"]] == [
            "default/deny-9999",
            "default/allow-client",
        ]
        assert body["policies"][0]["matched"] is True
        # URL-encoded parameters, the last value of a repeated one wins.
        r = await request(
            srv.port,
            "GET",
            "/debug/authz?src=spiffe%3A%2F%2Fcluster.local%2Fns%2Fdefault%2Fsa%2Fclient"
            "&dst=cluster1%2F%2Fv1%2FPod%2Fdefault%2Fserver&port=9999&port=8080",
        )
        assert r.status == 200
        assert json.loads(r.body)["decision"]["policy"] == "default/allow-client"
    finally:
        await srv.close()


async def test_endpoint_text(state: State) -> None:
    srv = await _serve(state)
    try:
        r = await request(
            srv.port,
            "GET",
            f"/debug/authz?src={OTHER_ID}&dst=10.2.0.2&port=8080",
            headers={"Accept": "text/plain"},
        )
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/plain")
        ex: Explanation = explain_query(state, {"src": OTHER_ID, "dst": "10.2.0.2", "port": "8080"})
        assert r.text == f"{ex}\n"
        assert f"decision:    DENY: {NOT_ALLOWED}" in r.text
        assert "ALLOW default/allow-client (workloadSelector): no match" in r.text
    finally:
        await srv.close()


async def test_endpoint_errors(state: State) -> None:
    srv = await _serve(state)
    unwired = await _serve(state, wired=False)
    try:
        r = await request(srv.port, "GET", "/debug/authz?dst=default/ghost&port=80")
        assert (r.status, r.text) == (
            404,
            "no workload 'default/ghost' (want a uid, namespace/name or IP)\n",
        )
        r = await request(srv.port, "GET", "/debug/authz?dst=default/server")
        assert (r.status, r.text) == (400, "port is required\n")
        r = await request(srv.port, "GET", "/debug/authz")
        assert r.status == 400
        assert (await request(srv.port, "POST", "/debug/authz?dst=x&port=1")).status == 405
        assert (
            await request(srv.port, "HEAD", f"/debug/authz?dst={SERVER_UID}&port=1")
        ).status == 200
        assert (await request(srv.port, "GET", "/debug/authz/x")).status == 404
        r = await request(unwired.port, "GET", f"/debug/authz?dst={SERVER_UID}&port=1")
        assert r.status == 503
        index = await request(srv.port, "GET", "/")
        assert 'href="debug/authz"' in index.text
    finally:
        await srv.close()
        await unwired.close()
