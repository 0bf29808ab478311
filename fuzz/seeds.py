"""Write the seed inputs of fuzz/corpus/ (``python fuzz/seeds.py``): valid and near-valid
examples of what each peer sends, built with the project's own encoders (and the h2 and hpack
libraries, independent of ours, for HTTP/2). Re-running rewrites the ``seed-*`` files only;
inputs found by fuzzing and kept by hand sit beside them."""

from __future__ import annotations

import contextlib
import hashlib
import ssl
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hpack  # noqa: E402

from ztunnel.hbone import h2conn as h2  # noqa: E402
from ztunnel.inpod import protocol as zds  # noqa: E402
from ztunnel.state.localconfig import load_local_config  # noqa: E402
from ztunnel.xds.convert import address_to_proto  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus"


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | ftype, flags, sid) + payload


def h2_server_seeds() -> list[bytes]:
    enc = hpack.Encoder()
    connect = enc.encode([(":method", "CONNECT"), (":authority", "10.0.0.2:8080")])
    huff = hpack.Encoder().encode(
        [(":method", "CONNECT"), (":authority", "10.0.0.2:80"), ("baggage", "a=b")], huffman=True
    )
    c = h2.H2Connection(client=True)
    sid = c.open_stream(
        "10.0.0.2:8080", [("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-00")]
    )
    ours = c.data_to_send_bytes()[len(h2.PREFACE) :]
    del sid
    seeds = [
        ours,
        frame(h2.HEADERS, 0x4, 1, connect) + frame(h2.DATA, 0, 1, b"hello") + frame(h2.DATA, 1, 1),
        frame(h2.HEADERS, 0x4, 1, huff) + frame(h2.RST_STREAM, 0, 1, b"\0\0\0\x08"),
        frame(h2.HEADERS, 0, 1, connect[:3]) + frame(h2.CONTINUATION, 0x4, 1, connect[3:]),
        frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 20) * 3)
        + frame(h2.PING, 0, 0, b"12345678")
        + frame(h2.WINDOW_UPDATE, 0, 0, b"\0\1\0\0"),
        frame(h2.HEADERS, 0x4 | 0x8 | 0x20, 3, b"\x02" + b"\0\0\0\1\x10" + connect + b"\0\0"),
        frame(h2.PRIORITY, 0, 5, b"\0\0\0\3\x10") + frame(h2.GOAWAY, 0, 0, b"\0\0\0\0\0\0\0\0"),
        frame(h2.DATA, 0x8, 1, b"\x03abc\0\0\0"),
    ]
    # the chunking byte first (see targets._chunks)
    return [bytes([i * 7]) + s for i, s in enumerate(seeds)]


def h2_client_seeds() -> list[bytes]:
    s = h2.H2Connection(client=False)
    s.data_to_send()
    c = h2.H2Connection(client=True)
    c.open_stream("10.0.0.1:8080")
    s.receive_data(c.data_to_send_bytes())
    s.data_to_send()
    s.send_response(1, 200, [("baggage", "k8s.cluster.name=c")])
    s.send_data(1, b"response body", end_stream=True)
    ok = s.data_to_send_bytes()
    enc = hpack.Encoder()
    seeds = [
        ok,
        frame(h2.HEADERS, 0x5, 1, enc.encode([(":status", "503")])),
        frame(h2.HEADERS, 0x4, 1, enc.encode([(":status", "100")]))
        + frame(h2.HEADERS, 0x4, 1, enc.encode([(":status", "200")])),
        frame(h2.GOAWAY, 0, 0, b"\0\0\0\0\0\0\0\x0b" + b"calm down"),
        frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 1, 0) + struct.pack(">HI", 5, 1 << 14)),
    ]
    return [bytes([i * 5 + 60]) + x for i, x in enumerate(seeds)]


def hpack_seeds() -> list[bytes]:
    return [
        h2._encode_block([(b":method", b"CONNECT"), (b":authority", b"1.2.3.4:80")], []),
        h2._encode_block([(b":status", b"200"), (b"baggage", b"x" * 300)], [0, 4096]),
        h2._encode_block([(b"x-" + b"n" * 200, b"")], []),
        hpack.Encoder().encode([(":path", "/"), ("custom", "v")]),
    ]


def client_hello_seeds() -> list[bytes]:
    out = []
    for alpn in (["h2"], ["http/1.1"], ["http/1.1", "h2"], None):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if alpn:
            ctx.set_alpn_protocols(alpn)
        inbio, outbio = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(inbio, outbio, server_hostname=None)
        with contextlib.suppress(ssl.SSLWantReadError):
            obj.do_handshake()
        out.append(outbio.read())
    return out


def zds_seeds() -> list[bytes]:
    def rec(data: bytes, fd: bool = False) -> bytes:
        assert len(data) < 64
        return bytes([len(data) | (0x80 if fd else 0)]) + data

    info = zds.WorkloadInfo("pod", "default", "sa")
    return [
        rec(zds.encode_add("uid-1", info), fd=True) + rec(zds.encode_snapshot_sent()),
        rec(zds.encode_keep("uid-2"))
        + rec(zds.encode_del("uid-2"))
        + rec(zds.encode_snapshot_sent()),
        rec(zds.encode_add("uid-3", None), fd=True) + rec(zds.encode_snapshot_sent()) * 2,
        rec(zds.encode_ack("oops")),
    ]


def xds_address_seeds() -> list[bytes]:
    cfg = load_local_config((ROOT / "ztunnel" / "examples" / "sandbox.yaml").read_text())
    out = [address_to_proto(w).SerializeToString() for w in cfg.workloads]
    out += [address_to_proto(s).SerializeToString() for s in cfg.services]
    return out[:12]


def xds_authorization_seeds() -> list[bytes]:
    from ztunnel.xds.protos import authorization_pb2 as authz_pb

    pol = authz_pb.Authorization(
        name="allow", namespace="default", scope=authz_pb.NAMESPACE, action=authz_pb.ALLOW
    )
    rule = pol.rules.add()
    clause = rule.clauses.add()
    m = clause.matches.add()
    m.destination_ports.append(8080)
    m.principals.add().exact = "spiffe://cluster.local/ns/default/sa/sleep"
    m.source_ips.add(address=bytes([10, 0, 0, 0]), length=8)
    m.not_namespaces.add().prefix = "kube-"
    deny = authz_pb.Authorization(name="deny", namespace="x", action=authz_pb.DENY, dry_run=True)
    return [pol.SerializeToString(), deny.SerializeToString(), b"\x0a\x00"]


def admin_http_seeds() -> list[bytes]:
    return [
        b"\x05GET /stats/prometheus HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n",
        b"\x10POST /logging?level=debug HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"\x3cGET /config_dump HTTP/1.0\r\n\r\n",
        b"\x01GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\nTransfer-Encoding: chunked\r\n\r\n",
    ]


def local_config_seeds() -> list[bytes]:
    ex = ROOT / "ztunnel" / "examples"
    return [
        (ex / "localhost.yaml").read_bytes(),
        (ex / "sandbox.yaml").read_bytes(),
        b"workloads: []\n",
    ]


def socks5_seeds() -> list[bytes]:
    import dns.message
    import dns.rrset

    q = dns.message.make_query("s1.default.svc.cluster.local", "A")
    r = dns.message.make_response(q)
    r.answer.append(dns.rrset.from_text(q.question[0].name, 30, "IN", "A", "10.96.0.20"))
    greeting = b"\x05\x01\x00"
    return [
        greeting + b"\x05\x01\x00\x01\x0a\x00\x02\x02\x1f\x90",
        greeting + b"\x05\x01\x00\x04" + bytes(15) + b"\x01\x00\x50",
        greeting + b"\x05\x01\x00\x03\x1cs1.default.svc.cluster.local\x00\x50",
        b"\x05\x02\x02\x00\x05\x02\x00\x01" + bytes(6),
        r.to_wire(),
    ]


SEEDS = {
    "h2_server": h2_server_seeds,
    "h2_client": h2_client_seeds,
    "hpack_block": hpack_seeds,
    "client_hello": client_hello_seeds,
    "zds": zds_seeds,
    "xds_address": xds_address_seeds,
    "xds_authorization": xds_authorization_seeds,
    "admin_http": admin_http_seeds,
    "local_config": local_config_seeds,
    "socks5": socks5_seeds,
}


def main() -> None:
    for name, make in SEEDS.items():
        d = CORPUS / name
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("seed-*"):
            old.unlink()
        for data in make():
            (d / f"seed-{hashlib.sha1(data).hexdigest()[:12]}").write_bytes(data)
        print(f"{name}: {len(list(d.iterdir()))} inputs")


if __name__ == "__main__":
    main()
