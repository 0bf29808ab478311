"""One proxied workload's listeners (outbound 15001, inbound plaintext 15006, inbound HBONE 15008,
and SOCKS5 on 127.0.0.1:15080 with ``UNSTABLE_ENABLE_SOCKS5``).

Dedicated mode runs one instance in ztunnel's own network namespace; in-pod (shared) mode runs
one per pod, with every socket created inside that pod's namespace, and, with ztunnel's own
workload known (POD_NAME, POD_NAMESPACE, SERVICE_ACCOUNT), the *self-proxy*: an instance for
ztunnel itself in its own namespace with the inbound HBONE listener only, so mesh clients reach
ztunnel's own ports (15020) over mTLS, under ztunnel's policies (Rust
``create_ztunnel_self_proxy_listener``). An instance owns its listeners, their connection tasks
and its HBONE connection pool.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ztunnel.config import (
    HBONE_PORT,
    INBOUND_PLAINTEXT_PORT,
    OUTBOUND_PORT,
    SOCKS5_HOST,
    SOCKS5_PORT,
    Config,
    ProxyMode,
    WorkloadInfo,
)
from ztunnel.core.addr import IPAddr
from ztunnel.core.identity import Identity
from ztunnel.identity.crl import CrlManager
from ztunnel.identity.manager import CertificateSource
from ztunnel.metrics import Metrics, Reporter
from ztunnel.net.copy import PipePool
from ztunnel.net.fdbudget import FdBudget
from ztunnel.net.sockopt import SocketConfig
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.hbone_outbound import HboneConnector
from ztunnel.proxy.inbound import InboundHbone
from ztunnel.proxy.inbound_passthrough import InboundPassthrough
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.outbound import Outbound
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.proxy.socks5 import DnsExchange, Socks5
from ztunnel.state.authz import PolicyIndex
from ztunnel.state.model import Workload
from ztunnel.state.store import State

log = logging.getLogger("ztunnel.proxy")


class Companion(Protocol):
    """Listeners of a higher layer that live and die with one instance (the DNS proxy): bound
    after the instance's own (any failure closes all), started, drained and closed with them.
    ``proxy`` never imports their layer; the composition root passes a builder in."""

    def bind(self) -> None: ...
    def start(self) -> None: ...
    def abort(self) -> None: ...
    async def drain(self, deadline: float | None) -> int: ...


CompanionBuilder = Callable[["ProxyInstance"], Sequence[Companion]]


class ProxyInstance:
    def __init__(
        self,
        config: Config,
        state: State,
        secrets: CertificateSource,
        pipes: PipePool | None,
        info: WorkloadInfo,
        *,
        netns_fd: int | None = None,
        extra_local_ips: frozenset[IPAddr] = frozenset(),
        name: str = "",
        metrics: Metrics | None = None,
        policies: PolicyIndex | None = None,
        companions: CompanionBuilder | None = None,
        self_proxy: bool = False,
    ) -> None:
        self.config = config
        self.state = state
        self.info = info
        self.name = name or f"{info.namespace}/{info.name}"
        # ztunnel's own inbound (see the module docstring): as Rust's, its sockets carry no
        # mark (DefaultSocketFactory) and never spoof the client (disable_inbound_freebind).
        self.self_proxy = self_proxy
        self._extra_ips = extra_local_ips
        self._identity: Identity | None = None
        self._ips_of: Workload | None = None
        self._ips: frozenset[IPAddr] = frozenset()
        # SOCKS5 hostnames are resolved by this instance's DNS proxy (Rust: the DNS server's
        # resolver); the composition root sets this when it builds the DNS companion.
        self.dns_exchange: DnsExchange | None = None
        self.sockets = SocketFactory(
            mark=None if self_proxy else config.packet_mark,
            netns_fd=netns_fd,
            socket_config=SocketConfig(
                config.keepalive_enabled,
                config.keepalive_time,
                config.keepalive_interval,
                config.keepalive_retries,
                config.user_timeout_enabled,
            ),
            budget=FdBudget(config.fd_reserve),
            # In-pod, the listeners are marked too (Rust InPodSocketFactory); dedicated mode
            # marks only what it dials (Rust MarkSocketFactory).
            mark_listeners=config.proxy_mode is ProxyMode.SHARED,
        )
        if config.enable_orig_src is False or self_proxy:
            # ENABLE_ORIG_SRC=false: no spoofing on the upstream leg to the app either (Rust
            # proxy.rs maybe_set_transparent): the app sees ztunnel's address.
            self.sockets.transparent_ok = False
        self.ctx = ProxyContext(
            config=config,
            state=state,
            sockets=self.sockets,
            pipes=pipes,
            local_workload=self.workload,
            workload_info=info,
            local_identity=self.identity,
            local_info=info,
            local_ips=self.local_ips,
            metrics=metrics,
            policies=policies,
        )
        self.connector = HboneConnector(config, self.sockets, secrets)
        self.ctx.hbone = self.connector
        self.inbound = InboundHbone(self.ctx, secrets)
        self.listeners: list[Listener] = []
        self.companions: list[Companion] = list(companions(self)) if companions else []

    # --- who this instance proxies for -------------------------------------------------------

    def workload(self) -> Workload | None:
        i = self.info
        return self.state.find_workload_by_info(
            i.name, i.namespace, i.service_account, self.config.node_name or None
        )

    def identity(self) -> Identity:
        wl = self.workload()
        trust_domain = wl.trust_domain if wl is not None else self.config.trust_domain
        ident = self._identity
        if ident is None or ident.trust_domain != trust_domain:
            # One object while the trust domain stays: every inbound connection keeps it.
            ident = self._identity = Identity(
                trust_domain, self.info.namespace, self.info.service_account
            )
        return ident

    def local_ips(self) -> frozenset[IPAddr]:
        wl = self.workload()
        if wl is None:
            return self._extra_ips
        if wl is not self._ips_of:  # (one set per workload object, not one per connection)
            self._ips_of, self._ips = wl, self._extra_ips.union(wl.addresses)
        return self._ips

    # --- lifecycle ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Create all listening sockets (inside the netns); on any failure, none stay open.
        With ``ENABLE_PROXY=false`` only the companions' (Rust proxyfactory.rs: no ``Proxy``,
        the DNS server alone); the self-proxy is made whatever ENABLE_PROXY says, as Rust's."""
        ctx = self.ctx
        inbound = (HBONE_PORT, "inbound", self.inbound.handle, Reporter.DESTINATION)
        handlers: list[tuple[int, str, Any, Reporter]] = [inbound]
        if not self.self_proxy:  # (the self-proxy is Rust's lone Inbound)
            outbound = Outbound(ctx)
            handlers = [
                (OUTBOUND_PORT, "outbound", outbound.handle, Reporter.SOURCE),
                (
                    INBOUND_PLAINTEXT_PORT,
                    "inbound_passthrough",
                    InboundPassthrough(ctx).handle,
                    Reporter.DESTINATION,
                ),
                inbound,
            ]
            if self.config.socks5:
                socks5 = Socks5(ctx, outbound, self.dns_exchange)
                handlers.append((SOCKS5_PORT, "socks5", socks5.handle, Reporter.SOURCE))
            if not self.config.enable_proxy:
                handlers = []
        try:
            for port, name, handler, reporter in handlers:
                sock = self._listen_socks5() if port == SOCKS5_PORT else self._listen(port)
                lst = Listener(sock, handler, f"{self.name} {name}")
                lst.budget = self.sockets.budget  # refuse connections within the fd reserve
                # accept()'s peer address: saves a getpeername (15001, 15006), and an access-log
                # line for a connection reset before it is served (15008)
                lst.pass_peer = port != SOCKS5_PORT
                if self.ctx.metrics is not None:
                    lst.on_socket = _socket_gauge(self.ctx.metrics, reporter)
                    lst.on_refused = functools.partial(
                        self.ctx.metrics.guard_event, "fd_budget_connection"
                    )
                self.listeners.append(lst)
            for i, comp in enumerate(self.companions):
                try:
                    comp.bind()
                except BaseException:
                    for done in self.companions[:i]:
                        done.abort()
                    raise
        except BaseException:
            for lst in self.listeners:
                lst.sock.close()
            self.listeners.clear()
            raise

    def _listen(self, port: int) -> socket.socket:
        cfg = self.config
        # The dual-stack IPv6 wildcard first, IPv4 alone if the pod has no IPv6. IP_TRANSPARENT
        # is best effort unless ENABLE_ORIG_SRC makes it required (true) or off (false).
        families = [socket.AF_INET6, socket.AF_INET] if cfg.ipv6_enabled else [socket.AF_INET]
        transparency = {None: (True, False), True: (True,), False: (False,)}[cfg.enable_orig_src]
        last: OSError | None = None
        for family in families:
            wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
            for transparent in transparency:
                try:
                    return self.sockets.listener(
                        (wildcard, port),
                        family=family,
                        reuse_port=cfg.inpod_port_reuse,
                        transparent=transparent,
                        keepalive=port != HBONE_PORT,  # (Rust: 15001 and 15006)
                    )
                except OSError as e:
                    last = OSError(e.errno, f"cannot bind [{wildcard}]:{port}: {e.strerror}")
                    if e.errno == errno.EADDRINUSE:
                        raise last from None
        assert last is not None
        raise last

    def _listen_socks5(self) -> socket.socket:
        """127.0.0.1:15080 only, as Rust (its dual-stack TODO)."""
        try:
            return self.sockets.listener(
                (SOCKS5_HOST, SOCKS5_PORT),
                family=socket.AF_INET,
                reuse_port=self.config.inpod_port_reuse,
                transparent=False,
            )
        except OSError as e:
            raise OSError(
                e.errno, f"cannot bind {SOCKS5_HOST}:{SOCKS5_PORT}: {e.strerror}"
            ) from None

    def start(self) -> None:
        for lst in self.listeners:
            lst.start()
            log.info("%s listening on %s:%d", lst.name, *lst.address)
        for comp in self.companions:
            comp.start()

    def live_connections(self) -> Iterable[Any]:
        """The live connection records (for /config_dump and /debug/connections)."""
        return self.ctx.tracker.live

    @property
    def active_connections(self) -> int:
        return sum(lst.active for lst in self.listeners)

    async def drain(self, deadline: float | None) -> int:
        """Graceful: stop accepting, GOAWAY to HBONE peers, let connections finish until the
        deadline (None: as long as they last), then cut the rest. Returns how many were cut."""
        self.inbound.send_goaway()
        cut = sum(
            await asyncio.gather(
                *(lst.drain(deadline) for lst in self.listeners),
                *(comp.drain(deadline) for comp in self.companions),
            )
        )
        self.connector.pool.close()
        return cut

    def recheck_policies(self) -> int:
        """Close inbound connections the current policies no longer allow."""
        ctx = self.ctx
        if ctx.policies is None:
            return 0
        return ctx.tracker.recheck(ctx.policies, self.workload(), ctx.authz_log_level)

    def close_revoked(self, crl: CrlManager) -> int:
        """After a CRL reload: close this instance's connections, inbound and outbound (pooled
        and double-HBONE inner), whose peer's verified chain is now revoked. Returns how many."""
        return self.inbound.close_revoked(crl) + self.connector.close_revoked(crl)

    async def close(self) -> None:
        """Immediate: listeners and every connection close now (a deleted pod)."""
        await self.drain(0)


def _socket_gauge(metrics: Metrics, reporter: Reporter) -> Callable[[bool], None]:
    def on_socket(opened: bool) -> None:
        if opened:
            metrics.socket_opened(reporter)
        else:
            metrics.socket_closed(reporter)

    return on_socket
