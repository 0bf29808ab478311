"""CPU cost of the in-handshake verify callback (ztunnel/identity/osslverify.py) per mTLS
handshake: in-process TLS 1.3 handshakes over memory BIOs, server context with the callback
(trust-domain check; optionally a CRL with N revoked serials) vs the same context without it,
rounds interleaved in one run.

Usage: ``python benchmarks/bench_verify.py [--handshakes 300] [--rounds 5] [--crl-entries 1000]``
"""

from __future__ import annotations

import argparse
import ssl
import statistics
import tempfile
import time
from pathlib import Path

from ztunnel.core.identity import Identity
from ztunnel.identity import osslverify
from ztunnel.identity.crl import CrlManager
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.tls import TLS_POLICY_MEMO, TlsPolicy, client_context, server_context
from ztunnel.testing.certs import revocation_list


def one_handshake(sctx: ssl.SSLContext, cctx: ssl.SSLContext) -> None:
    sin, sout, cin, cout = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = sctx.wrap_bio(sin, sout, server_side=True)
    c = cctx.wrap_bio(cin, cout, server_side=False, server_hostname=None)
    done_c = done_s = False
    for _ in range(10):
        if not done_c:
            try:
                c.do_handshake()
                done_c = True
            except ssl.SSLWantReadError:
                pass
        sin.write(cout.read())
        if not done_s:
            try:
                s.do_handshake()
                done_s = True
            except ssl.SSLWantReadError:
                pass
        cin.write(sout.read())
        if done_c and done_s:
            return
    raise RuntimeError("handshake did not complete")


def run(sctx: ssl.SSLContext, cctx: ssl.SSLContext, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        one_handshake(sctx, cctx)
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--handshakes", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--crl-entries", type=int, default=1000)
    args = ap.parse_args()
    ca = LocalCA.ephemeral()
    client = ca.issue(Identity("cluster.local", "default", "client"))
    cctx = client_context(client)
    with_cb = server_context(ca.issue(Identity("cluster.local", "default", "server")))
    real_install = osslverify.install
    osslverify.install = lambda ctx, check: False
    without = server_context(ca.issue(Identity("cluster.local", "default", "server")))
    osslverify.install = real_install
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "crl.pem"
        path.write_bytes(revocation_list(ca, list(range(1, args.crl_entries + 1))))
        crl_cert = ca.issue(Identity("cluster.local", "default", "server"))
        crl_cert.memo(TLS_POLICY_MEMO, lambda: TlsPolicy(crl=CrlManager(path)))
        with_crl = server_context(crl_cert)
        modes = {"no callback": without, "callback (trust domain)": with_cb}
        modes[f"callback + CRL ({args.crl_entries} entries)"] = with_crl
        results: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for name, sctx in modes.items():
                results[name].append(run(sctx, cctx, args.handshakes))
    base = statistics.median(results["no callback"])
    print(
        f"| server context | CPU µs per handshake (both sides, median of {args.rounds}) | vs none |"
    )
    print("|---|---|---|")
    for name, vals in results.items():
        med = statistics.median(vals)
        print(f"| {name} | {med:.0f} | {med / base:.3f}x |")


if __name__ == "__main__":
    main()
