"""The sandbox: a small two-node mesh in network namespaces, with ztunnel carrying real traffic.

Run as root: ``python -m ztunnel.testing.sandbox``. It builds node1 (pods ``sleep``, in the mesh,
and ``legacy``, not in the mesh) and node2 (pod ``echo``, in the mesh, behind the service VIP
10.96.0.10:80; pod ``waypoint``, the waypoint of service reviews at 10.96.0.11:80), plus a host
outside the mesh. Each node runs one ztunnel in shared (in-pod) mode,
fed over ZDS by a node agent (``ztunnel.testing.nodeagent``) that installs istio-cni's in-pod
rules (with DNS capture) and hands over each mesh pod's network namespace. ztunnel uses the
bundled config (``ztunnel/examples/sandbox.yaml``) and the local CA; its upstream resolver is a
dnsmasq on the outside host (node1's resolv.conf), and ``sleep`` has a Kubernetes-style
resolv.conf, so its lookups go through ztunnel's DNS proxy. The sandbox resolves names and sends
traffic, prints what ztunnel logged, and tears everything down (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from ztunnel.inpod.protocol import WorkloadInfo
from ztunnel.testing.apps import connect_from, recv_line, start_app, start_dnsmasq
from ztunnel.testing.netns import Host, Testbed
from ztunnel.testing.nodeagent import FakeNodeAgent
from ztunnel.testing.proc import Record, ZtunnelProcess

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "sandbox.yaml"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _exchange(label: str, src: Host, ip: str, port: int) -> None:
    t = time.monotonic()
    with connect_from(src, ip, port, timeout=10) as s:
        peer = recv_line(s).split()
        s.sendall(b"hello from the sandbox\n")
        reply = recv_line(s)
        s.shutdown(socket.SHUT_WR)
    ms = (time.monotonic() - t) * 1000
    _say(f"  {label:<48} app saw client {peer[1]:<12} reply={reply!r} ({ms:.1f} ms)")


def _lookup(label: str, src: Host, *cmd: str) -> str:
    t = time.monotonic()
    out = src.run(*cmd, check=False, timeout=20).stdout.split()
    ms = (time.monotonic() - t) * 1000
    got = out[0] if out else "(no answer)"
    _say(f"  {label:<58} -> {got:<12} ({ms:.1f} ms)")
    return got


def _start_dnsmasq(host: Host) -> None:
    """A plain foreground dnsmasq in the outside host's netns: the cluster's "kube-dns" for
    names outside the mesh."""
    try:
        start_dnsmasq(
            host,
            (host.ip4,),
            "--local=/example.test/",
            "--local=/cluster.local/",
            f"--host-record=outside.example.test,{host.ip4}",
        )
    except RuntimeError:
        raise SystemExit("dnsmasq did not start on the outside host") from None


def _describe(rec: Record) -> str:
    security = "mutual_tls" if "src.identity" in rec or "dst.identity" in rec else "plaintext"
    parts = [
        f"{rec.get('direction', '?'):8}",
        f"{rec.get('src.addr', '?'):>18} -> {rec.get('dst.addr', '?'):<18}",
    ]
    if "dst.hbone_addr" in rec:
        parts.append(f"hbone={rec['dst.hbone_addr']}")
    if "dst.service" in rec:
        parts.append(f"service={rec['dst.service']}")
    parts.append(f"security={security}")
    if "src.identity" in rec:
        parts.append(f"src.identity={rec['src.identity']}")
    if "dst.identity" in rec:
        parts.append(f"dst.identity={rec['dst.identity']}")
    parts.append(f"sent={rec.get('bytes_sent')} recv={rec.get('bytes_recv')} {rec.get('duration')}")
    if "error" in rec:
        parts.append(f"error={rec['error']}")
    return " ".join(parts)


def run(loop: str) -> int:
    with contextlib.ExitStack() as stack:
        tb = stack.enter_context(Testbed())
        _say(f"test bed ztb{tb.tag}")
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ztunnel-sandbox-"))
        t0 = time.monotonic()
        node1, node2 = tb.add_node("node1"), tb.add_node("node2")
        sleep, legacy = node1.add_pod("sleep"), node1.add_pod("legacy", ambient=False)
        echo, waypoint = node2.add_pod("echo"), node2.add_pod("waypoint")
        ext = tb.add_external("outside")
        for pod, want in (
            (sleep, "10.1.0.2"),
            (legacy, "10.1.0.3"),
            (echo, "10.2.0.2"),
            (waypoint, "10.2.0.3"),
        ):
            if pod.ip4 != want:
                raise SystemExit(
                    f"test bed gave {pod.name} {pod.ip4}, the bundled config expects {want}"
                )
        _say(
            f"cluster: node1[sleep {sleep.ip4}, legacy {legacy.ip4} (not in mesh)], "
            f"node2[echo {echo.ip4}, waypoint {waypoint.ip4}], outside host {ext.ip4}; "
            "service echo.default.svc.cluster.local = 10.96.0.10:80, "
            "reviews.default.svc.cluster.local = 10.96.0.11:80 (through the waypoint)"
        )
        # One ztunnel per node (shared/in-pod mode), fed by a node agent over ZDS that installs
        # istio-cni's rules in each mesh pod and hands over the pod's network namespace.
        common = {
            "PROXY_MODE": "shared",
            "LOCAL_XDS_PATH": str(CONFIG),
            "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
        }
        # DNS: dnsmasq on the outside host is ztunnel's upstream (node1's resolv.conf); sleep
        # asks "kube-dns" (10.96.0.53), which istio-cni's DNS capture sends to ztunnel's 15053.
        _start_dnsmasq(ext)
        node1.set_resolv_conf(f"nameserver {ext.ip4}\n")
        sleep.set_resolv_conf(
            "search default.svc.cluster.local svc.cluster.local cluster.local\n"
            "nameserver 10.96.0.53\noptions ndots:5\n"
        )
        zts: dict[str, ZtunnelProcess] = {}
        for node, pods in ((node1, [sleep]), (node2, [echo, waypoint])):
            uds = os.path.join(tmp, f"{node.name}.sock")
            agent = stack.enter_context(FakeNodeAgent(uds, dns_capture=True))
            for pod in pods:
                agent.put_pod(f"uid-{pod.name}", WorkloadInfo(pod.name, "default", pod.name), pod)
            env = {**common, "NODE_NAME": node.name, "INPOD_UDS": uds}
            zts[node.name] = ZtunnelProcess(node, env, loop=loop).start()
            agent.wait_for_snapshot()
        start_app(echo, "echo", "--announce", ports=(8080,))
        start_app(ext, "echo", "--announce", ports=(9000,))
        # The waypoint proxy's stand-in: it sends what it gets on to the echo pod (its own
        # outbound, captured by its ztunnel like any mesh pod's).
        start_app(waypoint, "forward", "--to", f"{echo.ip4}:8080", ports=(80,))
        _say(
            f"ready in {time.monotonic() - t0:.2f}s: one ztunnel per node (in-pod mode), "
            f"local CA in {tmp}/ca\n"
        )

        _say("DNS from sleep (captured to ztunnel's DNS proxy on 15053 in sleep's netns):")
        vip = _lookup(
            "getent hosts echo (answered from ztunnel's state)", sleep, "getent", "hosts", "echo"
        )
        _lookup(
            "dig +short echo.default.svc.cluster.local AAAA (no IPv6 VIP)",
            sleep,
            "dig",
            "+short",
            "echo.default.svc.cluster.local",
            "AAAA",
        )
        outside = _lookup(
            "getent hosts outside.example.test (forwarded to dnsmasq)",
            sleep,
            "getent",
            "hosts",
            "outside.example.test",
        )

        _say("\ntraffic:")
        if vip == "10.96.0.10":
            _exchange("sleep -> echo by name (the VIP from DNS, HBONE)", sleep, vip, 80)
        if outside == ext.ip4:
            _exchange("sleep -> outside.example.test (passthrough)", sleep, outside, 9000)
        _exchange("sleep -> echo pod (HBONE)", sleep, echo.ip4, 8080)
        _exchange("sleep -> echo pod over IPv6 (HBONE)", sleep, echo.ip6, 8080)
        _exchange("sleep -> service VIP 10.96.0.10:80 (HBONE)", sleep, "10.96.0.10", 80)
        _exchange("sleep -> reviews 10.96.0.11:80 via its waypoint", sleep, "10.96.0.11", 80)
        _exchange("sleep -> outside host (passthrough)", sleep, ext.ip4, 9000)
        _exchange("legacy (no mesh) -> echo (inbound plaintext)", legacy, echo.ip4, 8080)

        time.sleep(0.3)
        for name, zt in zts.items():
            _say(f"\nztunnel on {name}: access log")
            for rec in zt.access():
                _say("  " + _describe(rec))
        rcs = {name: zt.stop() for name, zt in zts.items()}
        for name, zt in zts.items():
            for rec in zt.internal_errors():
                _say(f"ztunnel on {name} logged an internal error: {rec}")
        _say(f"\nztunnel exit codes: {rcs}; tearing down")
    _say("sandbox removed: no namespaces or rules left behind")
    return 0 if all(rc == 0 for rc in rcs.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ztunnel.testing.sandbox", description=__doc__.splitlines()[0]
    )
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = p.parse_args(argv)
    try:
        return run(args.loop)
    except KeyboardInterrupt:
        _say("interrupted; everything was torn down")
        return 130


if __name__ == "__main__":
    sys.exit(main())
