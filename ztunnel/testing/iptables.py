"""Text of the istio-cni in-pod and host-probe iptables rules, in iptables-restore form (pure).

Mirrors ``istio/istio:cni/pkg/iptables/iptables.go`` (REDIRECT variant, current) and its golden
files ``cni/pkg/iptables/testdata/default*.golden`` and ``hostprobe*.golden``: same tables, chains,
rule order and match spelling. The test bed feeds these strings to ``iptables-restore --noflush``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

INPOD_MARK: Final = 0x539  # 1337: ztunnel's SO_MARK on every socket it makes in the pod
INPOD_MASK: Final = 0xFFF
INPOD_TPROXY_MARK: Final = 0x111
INPOD_TPROXY_MASK: Final = 0xFFF
INPOD_RESTORE_MASK: Final = 0xFFFFFFFF
ROUTE_TABLE_INBOUND: Final = 100
IP_RULE_PREF: Final = 32764

CHAIN_OUTPUT: Final = "ISTIO_OUTPUT"
CHAIN_PRERT: Final = "ISTIO_PRERT"
CHAIN_POSTRT: Final = "ISTIO_POSTRT"

PORT_OUTBOUND: Final = 15001
PORT_INBOUND_PLAINTEXT: Final = 15006
PORT_INBOUND_HBONE: Final = 15008
PORT_DNS: Final = 15053

PROBE_SNAT_V4: Final = "169.254.7.127"
PROBE_SNAT_V6: Final = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
PROBE_IPSET: Final = "istio-inpod-probes"

_MARK = f"0x{INPOD_MARK:x}/0x{INPOD_MASK:x}"
_TPROXY_MARK = f"0x{INPOD_TPROXY_MARK:x}/0x{INPOD_TPROXY_MASK:x}"


def inpod_restore(*, ipv6: bool, dns_capture: bool) -> str:
    """The ``iptables-restore`` input (``ip6tables-restore`` when ``ipv6``) for one pod netns."""
    localhost = "::1/128" if ipv6 else "127.0.0.1/32"
    probe = PROBE_SNAT_V6 if ipv6 else PROBE_SNAT_V4
    restore = f"0x{INPOD_RESTORE_MASK:x}"
    out: list[str] = [
        "*mangle",
        f"-N {CHAIN_PRERT}",
        f"-N {CHAIN_OUTPUT}",
        f"-A PREROUTING -j {CHAIN_PRERT}",
        f"-A OUTPUT -j {CHAIN_OUTPUT}",
        f"-A {CHAIN_PRERT} -m mark --mark {_MARK} -j CONNMARK --set-xmark {_TPROXY_MARK}",
        f"-A {CHAIN_OUTPUT} -m connmark --mark {_TPROXY_MARK} -j CONNMARK --restore-mark"
        f" --nfmask {restore} --ctmask {restore}",
        "COMMIT",
        "*nat",
        f"-N {CHAIN_PRERT}",
        f"-N {CHAIN_OUTPUT}",
        f"-A OUTPUT -j {CHAIN_OUTPUT}",
        f"-A PREROUTING -j {CHAIN_PRERT}",
        f"-A {CHAIN_PRERT} -s {probe} -p tcp -m tcp -j ACCEPT",
        f"-A {CHAIN_OUTPUT} -d {probe} -p tcp -m tcp -j ACCEPT",
        f"-A {CHAIN_PRERT} ! -d {localhost} -p tcp ! --dport {PORT_INBOUND_HBONE}"
        f" -m mark ! --mark {_MARK} -j REDIRECT --to-ports {PORT_INBOUND_PLAINTEXT}",
    ]
    if dns_capture:
        out += [
            f"-A {CHAIN_OUTPUT} ! -o lo -p udp -m mark ! --mark {_MARK} -m udp --dport 53"
            f" -j REDIRECT --to-port {PORT_DNS}",
            f"-A {CHAIN_OUTPUT} ! -d {localhost} -p tcp --dport 53 -m mark ! --mark {_MARK}"
            f" -j REDIRECT --to-ports {PORT_DNS}",
        ]
    out += [
        f"-A {CHAIN_OUTPUT} -p tcp -m mark --mark {_TPROXY_MARK} -j ACCEPT",
        f"-A {CHAIN_OUTPUT} ! -d {localhost} -o lo -j ACCEPT",
        f"-A {CHAIN_OUTPUT} ! -d {localhost} -p tcp -m mark ! --mark {_MARK}"
        f" -j REDIRECT --to-ports {PORT_OUTBOUND}",
        "COMMIT",
    ]
    if dns_capture:
        out += [
            "*raw",
            f"-N {CHAIN_OUTPUT}",
            f"-N {CHAIN_PRERT}",
            f"-A PREROUTING -j {CHAIN_PRERT}",
            f"-A OUTPUT -j {CHAIN_OUTPUT}",
            f"-A {CHAIN_OUTPUT} -p udp -m mark --mark {_MARK} -m udp --dport 53 -j CT --zone 1",
            f"-A {CHAIN_PRERT} -p udp -m mark ! --mark {_MARK} -m udp --sport 53 -j CT --zone 1",
            "COMMIT",
        ]
    return "\n".join(out) + "\n"


def inpod_delete_restore(*, dns_capture: bool) -> str:
    """``iptables-restore --noflush`` input that removes exactly what ``inpod_restore`` added."""
    tables = [("mangle", ("PREROUTING", "OUTPUT")), ("nat", ("OUTPUT", "PREROUTING"))]
    if dns_capture:
        tables.append(("raw", ("PREROUTING", "OUTPUT")))
    jumps = {"PREROUTING": CHAIN_PRERT, "OUTPUT": CHAIN_OUTPUT}
    out: list[str] = []
    for table, builtins in tables:
        out.append(f"*{table}")
        out += [f"-D {b} -j {jumps[b]}" for b in builtins]
        out += [f"{op} {c}" for op in ("-F", "-X") for c in (CHAIN_PRERT, CHAIN_OUTPUT)]
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def inpod_ip_batch(*, ipv6: bool, add: bool = True) -> str:
    """``ip -batch`` input (run with ``ip -6`` when ``ipv6``) for the in-pod policy routing:
    ``rule fwmark 0x111/0xfff pref 32764 lookup 100`` and ``route local <any> dev lo table 100``."""
    op = "add" if add else "del"
    dst = "::/0" if ipv6 else "0.0.0.0/0"
    return (
        f"rule {op} fwmark {_TPROXY_MARK} pref {IP_RULE_PREF} lookup {ROUTE_TABLE_INBOUND}\n"
        f"route {op} local {dst} dev lo table {ROUTE_TABLE_INBOUND}\n"
    )


def host_probe_restore(
    *, ipv6: bool, dst_ips: Iterable[str] = (), ipset: bool = False, create_chain: bool = True
) -> str:
    """Node-side probe SNAT (``hostprobe*.golden``) for ``iptables-restore --noflush``.

    With ``ipset`` the rule matches ``istio-inpod-probes-v4``/``-v6`` exactly like istio-cni;
    without, one rule per destination IP (``-d IP``) replaces the set match, since the ``ipset``
    tool may be missing. ``create_chain=False`` only appends rules to an existing chain.
    """
    snat = PROBE_SNAT_V6 if ipv6 else PROBE_SNAT_V4
    out = ["*nat"]
    if create_chain:
        out += [f"-N {CHAIN_POSTRT}", f"-I POSTROUTING 1 -j {CHAIN_POSTRT}"]
    if ipset:
        setname = f"{PROBE_IPSET}-{'v6' if ipv6 else 'v4'}"
        out.append(
            f"-A {CHAIN_POSTRT} -m owner --socket-exists -p tcp -m set --match-set {setname} dst"
            f" -j SNAT --to-source {snat}"
        )
    else:
        out += [
            f"-A {CHAIN_POSTRT} -d {ip} -m owner --socket-exists -p tcp -j SNAT --to-source {snat}"
            for ip in dst_ips
        ]
    out.append("COMMIT")
    return "\n".join(out) + "\n"
