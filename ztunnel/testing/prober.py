"""An honest HBONE client that measures its service while something else attacks the server.

``python -m ztunnel.testing.prober --server IP --target IP:PORT --cert C --key K --ca CA
--stop FILE`` connects to ``IP:15008`` with the given certificate, opens a CONNECT tunnel to
``--target`` (an echo app), prints ``READY``, then every ``--interval`` seconds sends a short
line and times its echo; every ``--new-stream-every`` samples it also times a new CONNECT (to
its 200). Once ``FILE`` exists it prints ``DONE <samples> <worst ms> <median ms> <errors>``
and exits. It runs as its own process so that the attacker in the test process (and its GIL)
does not inflate the figures.

Product code never imports this module.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import statistics
import sys
import time
from collections.abc import Sequence

from ztunnel.testing.hbone import HboneClient


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ztunnel.testing.prober")
    ap.add_argument("--server", required=True)
    ap.add_argument("--port", type=int, default=15008)
    ap.add_argument("--target", required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--ca", required=True)
    ap.add_argument("--stop", required=True)
    ap.add_argument("--interval", type=float, default=0.005)
    ap.add_argument("--new-stream-every", type=int, default=20)
    args = ap.parse_args(argv)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["h2"])
    ctx.check_hostname = False
    ctx.load_verify_locations(args.ca)
    ctx.load_cert_chain(args.cert, args.key)
    family = socket.AF_INET6 if ":" in args.server else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect((args.server, args.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = HboneClient(ctx.wrap_socket(sock, server_hostname=None), timeout=5.0)
    sid = client.connect_stream(args.target)
    print("READY", flush=True)
    samples: list[float] = []
    kinds: list[str] = []
    errors: list[str] = []
    i = 0
    while not os.path.exists(args.stop):
        try:
            msg = b"probe %d\n" % i
            t = time.monotonic()
            client.send(sid, msg)
            got = client.read(sid, len(msg))
            samples.append(time.monotonic() - t)
            kinds.append("echo")
            if got != msg:
                errors.append(f"echo mismatch {got!r}")
            i += 1
            if args.new_stream_every and i % args.new_stream_every == 0:
                t = time.monotonic()
                extra = client.connect_stream(args.target)
                samples.append(time.monotonic() - t)
                kinds.append("connect")
                client.end(extra)
        except Exception as e:
            errors.append(repr(e))
            break
        time.sleep(args.interval)
    worst = max(samples) * 1000 if samples else -1.0
    median = statistics.median(samples) * 1000 if samples else -1.0
    top = sorted(range(len(samples)), key=lambda k: -samples[k])[:5]
    print("TOP " + " ".join(f"{samples[k] * 1000:.1f}@{k}/{kinds[k]}" for k in top), flush=True)
    print(f"DONE {len(samples)} {worst:.2f} {median:.2f} {len(errors)}", flush=True)
    for err in errors[:5]:
        print(f"ERROR {err}", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
