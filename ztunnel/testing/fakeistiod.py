"""A fake istiod for tests: a real gRPC server on loopback serving delta ADS and the Istio CA.

It speaks the same protos as istiod (``ztunnel/xds/protos``), over plaintext or TLS (a server
certificate for ``istiod.istio-system.svc``, 127.0.0.1 and ::1 signed by the fake's CA root).

* xDS: keeps a table of Address and Authorization resources. A new stream gets, per type it
  subscribes to, one response with every resource it does not already hold at the same version
  (``initial_resource_versions``) plus removals for the names it holds that no longer exist,
  as istiod does. ``set_*``/``remove_*``/``push`` change the table and send one delta response
  to every subscribed stream; they return the nonces sent, and ``wait_response(nonce)`` returns
  the client's ACK or NACK of it. Every request, the call metadata (headers) and the Node are
  recorded. Faults: fail the live streams with a gRPC status, refuse the next streams, drop
  every connection, stop/restart the server on the same port, delay responses, send undecodable
  or empty resources (``push_raw``), require a bearer token.
* CA: ``CreateCertificate`` signs the CSR with a :class:`LocalCA` (the impersonated identity in
  the request metadata if present, else the CSR's SAN) for the requested validity. Faults: fail
  (all or the next N), delay, sign a different identity than asked, or rewrite the chain.

Product code never imports this module. It relies on grpclib 0.4's ``Server._protocol_factory``
to track connections so it can drop them abruptly.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import itertools
import logging
import os
import socket
import ssl
import tempfile
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from google.protobuf import any_pb2
from google.protobuf.message import Message
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import first_identity, load_pem_certificates
from ztunnel.identity.localca import LocalCA
from ztunnel.state.model import Authorization, Service, Workload
from ztunnel.xds.convert import (
    ADDRESS_TYPE_URL,
    AUTHORIZATION_TYPE_URL,
    address_to_proto,
    authorization_to_proto,
)
from ztunnel.xds.protos import authorization_pb2 as authz_pb
from ztunnel.xds.protos import ca_pb2
from ztunnel.xds.protos import discovery_pb2 as ds
from ztunnel.xds.protos import workload_pb2 as wl_pb

__all__ = ["ISTIOD_SAN", "CsrRecord", "FakeIstiod", "StreamRecord", "XdsRequestRecord"]

log = logging.getLogger(__name__)

ISTIOD_SAN = "istiod.istio-system.svc"

_ADS = ds.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"]
_ADS_PATH = f"/{_ADS.full_name}/DeltaAggregatedResources"
_CA = ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"]
_CA_PATH = f"/{_CA.full_name}/CreateCertificate"

_T = TypeVar("_T")

AddressLike = Workload | Service | wl_pb.Workload | wl_pb.Service | wl_pb.Address
PolicyLike = Authorization | authz_pb.Authorization


@dataclass
class StreamRecord:
    """One ADS stream as the server saw it."""

    id: int
    metadata: list[tuple[str, str]]
    requests: list[ds.DeltaDiscoveryRequest] = field(default_factory=list)
    closed: bool = False

    def header(self, name: str) -> str | None:
        for k, v in self.metadata:
            if k == name:
                return v
        return None

    @property
    def node(self) -> ds.Node | None:
        """The Node of the first request that carried one."""
        for r in self.requests:
            if r.HasField("node"):
                return r.node
        return None

    def initial_requests(self) -> list[ds.DeltaDiscoveryRequest]:
        return [r for r in self.requests if not r.response_nonce]


@dataclass(frozen=True)
class XdsRequestRecord:
    """One DeltaDiscoveryRequest, with the stream it came on."""

    stream_id: int
    request: ds.DeltaDiscoveryRequest

    @property
    def is_ack(self) -> bool:
        return bool(self.request.response_nonce) and not self.request.HasField("error_detail")

    @property
    def is_nack(self) -> bool:
        return bool(self.request.response_nonce) and self.request.HasField("error_detail")

    @property
    def error_message(self) -> str:
        return self.request.error_detail.message


@dataclass(frozen=True)
class CsrRecord:
    """One CreateCertificate call: the request, its metadata, and the identity signed (if any)."""

    request: ca_pb2.IstioCertificateRequest
    metadata: list[tuple[str, str]]
    signed: Identity | None

    def header(self, name: str) -> str | None:
        for k, v in self.metadata:
            if k == name:
                return v
        return None


@dataclass
class _StoredResource:
    version: str
    payload: any_pb2.Any | None  # None: a Resource without its `resource` field (malformed)


class _End:
    """Queue sentinel: finish the stream with status OK (the client half-closed, or a test
    asked)."""


@dataclass(frozen=True)
class _Fail:
    status: Status
    message: str


class _LiveStream:
    def __init__(self, record: StreamRecord) -> None:
        self.record = record
        self.queue: asyncio.Queue[ds.DeltaDiscoveryResponse | _End | _Fail] = asyncio.Queue()
        # type URL -> None (wildcard) or the subscribed names; absent: not subscribed.
        self.subscriptions: dict[str, set[str] | None] = {}
        self.nonces = itertools.count(1)

    def wants(self, type_url: str, name: str) -> bool:
        if type_url not in self.subscriptions:
            return False
        names = self.subscriptions[type_url]
        return names is None or name in names


class _TrackingServer(Server):
    """grpclib's Server, remembering each connection's transport so tests can cut it."""

    def __init__(self, handlers: Collection[Any]) -> None:
        super().__init__(handlers)
        self.transports: set[asyncio.BaseTransport] = set()

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        made, lost = proto.connection_made, proto.connection_lost
        mine: list[asyncio.BaseTransport] = []

        def connection_made(transport: asyncio.BaseTransport) -> None:
            mine.append(transport)
            self.transports.add(transport)
            made(transport)

        def connection_lost(exc: BaseException | None) -> None:
            for t in mine:
                self.transports.discard(t)
            lost(exc)

        proto.connection_made = connection_made  # type: ignore[method-assign]
        proto.connection_lost = connection_lost  # type: ignore[method-assign]
        return proto


def _server_tls_context(ca: LocalCA, names: Sequence[str]) -> ssl.SSLContext:
    """A server context with a leaf for ``names`` (DNS and IP SANs) signed by ``ca``'s root."""
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.root_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca.root_key, hashes.SHA256())
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory(prefix="fakeistiod-") as d:
        cert_path, key_path = Path(d, "cert.pem"), Path(d, "key.pem")
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        os.chmod(key_path, 0o600)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def _address_name(pb: wl_pb.Address) -> str:
    if pb.WhichOneof("type") == "workload":
        return pb.workload.uid
    return f"{pb.service.namespace}/{pb.service.hostname}"


def _stream_node(live: _LiveStream) -> str:
    node = live.record.node
    if node is None or "NODE_NAME" not in node.metadata.fields:
        return ""
    return str(node.metadata.fields["NODE_NAME"].string_value)


def _workload_node(payload: any_pb2.Any) -> str:
    pb = wl_pb.Address()
    try:
        payload.Unpack(pb)
    except Exception:
        return ""
    return pb.workload.node if pb.WhichOneof("type") == "workload" else ""


def _aliases(pb: wl_pb.Address) -> list[str]:
    """The ``<network>/<ip>`` keys istiod's ambient index answers for this address."""
    if pb.WhichOneof("type") == "workload":
        w = pb.workload
        return [f"{w.network}/{ipaddress.ip_address(a)}" for a in w.addresses if len(a) in (4, 16)]
    out = []
    for a in pb.service.addresses:
        if len(a.address) in (4, 16):
            out.append(f"{a.network}/{ipaddress.ip_address(a.address)}")
    return out


def _to_address(obj: AddressLike) -> wl_pb.Address:
    if isinstance(obj, Workload | Service):
        return address_to_proto(obj)
    if isinstance(obj, wl_pb.Workload):
        return wl_pb.Address(workload=obj)
    if isinstance(obj, wl_pb.Service):
        return wl_pb.Address(service=obj)
    return obj


def _to_policy(obj: PolicyLike) -> authz_pb.Authorization:
    return authorization_to_proto(obj) if isinstance(obj, Authorization) else obj


def _pack(type_url: str, msg: Message) -> any_pb2.Any:
    return any_pb2.Any(type_url=type_url, value=msg.SerializeToString())


class FakeIstiod:
    """See the module docstring. Use as ``async with FakeIstiod(...) as istiod:``.

    ``tls``: serve TLS (``root_pem`` is the root to trust). ``ca``: the CA that signs workload
    certificates and the TLS server certificate (default: a fresh ephemeral one).
    ``accept_tokens``: if given, calls must carry ``authorization: Bearer <one of them>`` or
    fail with UNAUTHENTICATED.
    """

    def __init__(
        self,
        *,
        tls: bool = False,
        ca: LocalCA | None = None,
        server_names: Sequence[str] = (ISTIOD_SAN, "127.0.0.1", "::1"),
        accept_tokens: Iterable[str] | None = None,
    ) -> None:
        self.ca = ca if ca is not None else LocalCA.ephemeral()
        self.tls = tls
        self._ssl = _server_tls_context(self.ca, server_names) if tls else None
        self.accept_tokens: set[str] | None = set(accept_tokens) if accept_tokens else None
        self._host = "127.0.0.1"
        self._port = 0
        self._premade = False  # started on a caller's socket: restart cannot re-create it
        self._server: _TrackingServer | None = None
        self._versions = itertools.count(1)
        self._stream_ids = itertools.count(1)
        self._resources: dict[str, dict[str, _StoredResource]] = {
            ADDRESS_TYPE_URL: {},
            AUTHORIZATION_TYPE_URL: {},
        }
        self._live: set[_LiveStream] = set()
        self._changed = asyncio.Event()
        self._sent: dict[int, set[str]] = {}  # stream id -> nonces written to it
        # -- observations
        self.streams: list[StreamRecord] = []
        self.requests: list[XdsRequestRecord] = []
        self.csrs: list[CsrRecord] = []
        # -- xDS faults
        self.response_delay = 0.0
        self.refuse_streams = 0  # refuse this many next streams with refuse_status
        self.refuse_status = Status.UNAVAILABLE
        # -- CA faults
        self.ca_unavailable = False  # fail every CreateCertificate while set
        self.ca_fail_next = 0  # fail this many next calls
        self.ca_delay = 0.0
        self.ca_wrong_identity: Identity | None = None  # sign this instead of what was asked
        # Rewrite the response chain (e.g. drop the roots, return nothing, return garbage).
        self.ca_chain_transform: Callable[[list[str]], list[str]] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None
    ) -> None:
        """Listen on ``host:port`` (port 0: any; a restart reuses the first port).

        ``sock``: serve on this already bound and listening TCP socket instead (e.g. one made
        inside a test-bed network namespace, see ``ztunnel.testing.apps.listen_in``); the
        server owns it from now on. Connections already waiting in its backlog are served.
        ``restart`` is not possible then (the socket's namespace is not known here): call
        ``stop`` and ``start(sock=...)`` with a new socket instead.
        """
        if self._server is not None:
            raise RuntimeError("already started")
        if sock is not None:
            sock.setblocking(False)
            host, port = sock.getsockname()[:2]
            self._premade = True
        else:
            if self._premade:
                raise RuntimeError("started on a pre-made socket: pass a new one to start()")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port or self._port))
                sock.listen(64)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        self._host, self._port = host, sock.getsockname()[1]
        server = _TrackingServer([self])
        await server.start(sock=sock, ssl=self._ssl)
        self._server = server

    async def stop(self) -> None:
        """Stop listening and cut every connection abruptly (an istiod outage)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for t in list(server.transports):
            t.abort()  # type: ignore[attr-defined]
        await server.wait_closed()
        self._live.clear()

    async def restart(self) -> None:
        await self.stop()
        await self.start(self._host, self._port)

    async def __aenter__(self) -> FakeIstiod:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """The URL for XDS_ADDRESS / CA_ADDRESS."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{'https' if self.tls else 'http'}://{host}:{self._port}"

    @property
    def root_pem(self) -> str:
        """The root that signs both the TLS server certificate and the workload certificates."""
        return self.ca.root_pem

    # -- xDS: the resource table ----------------------------------------------------------------

    def set_addresses(self, *items: AddressLike, version: str | None = None) -> list[str]:
        """Add or replace workloads/services (model objects or protobuf) in one push."""
        upserts = []
        for obj in items:
            pb = _to_address(obj)
            upserts.append((_address_name(pb), _pack(ADDRESS_TYPE_URL, pb)))
        return self._push(ADDRESS_TYPE_URL, upserts, (), version)

    def set_policies(self, *items: PolicyLike, version: str | None = None) -> list[str]:
        """Add or replace authorization policies in one push."""
        upserts = []
        for obj in items:
            pb = _to_policy(obj)
            upserts.append((f"{pb.namespace}/{pb.name}", _pack(AUTHORIZATION_TYPE_URL, pb)))
        return self._push(AUTHORIZATION_TYPE_URL, upserts, (), version)

    def remove_addresses(self, *names: str) -> list[str]:
        return self._push(ADDRESS_TYPE_URL, (), names, None)

    def remove_policies(self, *names: str) -> list[str]:
        return self._push(AUTHORIZATION_TYPE_URL, (), names, None)

    def push(
        self,
        type_url: str,
        upserts: Sequence[tuple[str, Message]] = (),
        removals: Sequence[str] = (),
        version: str | None = None,
    ) -> list[str]:
        """Upsert (name, message) pairs and remove names of ``type_url`` in one response."""
        packed = [(name, _pack(type_url, msg)) for name, msg in upserts]
        return self._push(type_url, packed, removals, version)

    def push_raw(
        self,
        type_url: str,
        name: str,
        value: bytes | None,
        *,
        any_type_url: str | None = None,
        version: str | None = None,
    ) -> list[str]:
        """Store and push a resource whose payload is arbitrary bytes (``None``: no payload at
        all), e.g. garbage that does not decode; ``any_type_url`` overrides the Any's type."""
        payload = None
        if value is not None:
            payload = any_pb2.Any(type_url=any_type_url or type_url, value=value)
        return self._push(type_url, [(name, payload)], (), version)

    def resource_names(self, type_url: str) -> list[str]:
        return sorted(self._resources[type_url])

    def _push(
        self,
        type_url: str,
        upserts: Sequence[tuple[str, any_pb2.Any | None]],
        removals: Iterable[str],
        version: str | None,
    ) -> list[str]:
        table = self._resources[type_url]
        ver = version or f"v{next(self._versions)}"
        for name, payload in upserts:
            table[name] = _StoredResource(ver, payload)
        removed = list(removals)
        for name in removed:
            table.pop(name, None)
        nonces = []
        for live in list(self._live):
            if type_url not in live.subscriptions:
                continue
            names = live.subscriptions[type_url]
            if names is not None and type_url == ADDRESS_TYPE_URL:
                # On-demand streams also get new workloads on their own node (istiod's
                # AdditionalPodSubscriptions), and are subscribed to them from then on.
                node = _stream_node(live)
                for name, payload in upserts:
                    if node and payload is not None and _workload_node(payload) == node:
                        names.add(name)
            resp = ds.DeltaDiscoveryResponse(type_url=type_url, system_version_info=ver)
            for name, _ in upserts:
                if live.wants(type_url, name):
                    self._add_resource(resp, name, table[name])
            resp.removed_resources.extend(n for n in removed if live.wants(type_url, n))
            nonces.append(self._send(live, resp))
        return nonces

    @staticmethod
    def _add_resource(resp: ds.DeltaDiscoveryResponse, name: str, stored: _StoredResource) -> None:
        r = resp.resources.add(name=name, version=stored.version)
        if stored.payload is not None:
            r.resource.CopyFrom(stored.payload)

    def _send(self, live: _LiveStream, resp: ds.DeltaDiscoveryResponse) -> str:
        resp.nonce = f"{live.record.id}-{next(live.nonces)}"
        live.queue.put_nowait(resp)
        return resp.nonce

    # -- xDS: faults ----------------------------------------------------------------------------

    def fail_streams(
        self, status: Status = Status.UNAVAILABLE, message: str = "fake istiod: stream failed"
    ) -> int:
        """End every live ADS stream with ``status``; returns how many were ended."""
        n = 0
        for live in list(self._live):
            live.queue.put_nowait(_Fail(status, message))
            n += 1
        return n

    def end_streams(self) -> int:
        """End every live ADS stream normally (status OK), as istiod does on max connection age."""
        n = 0
        for live in list(self._live):
            live.queue.put_nowait(_End())
            n += 1
        return n

    def drop_connections(self) -> int:
        """Abort every TCP connection (no GOAWAY, no status): a crashed or partitioned istiod."""
        if self._server is None:
            return 0
        transports = list(self._server.transports)
        for t in transports:
            t.abort()  # type: ignore[attr-defined]
        return len(transports)

    # -- observation ----------------------------------------------------------------------------

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait_for(self, predicate: Callable[[], _T | None], timeout: float = 5.0) -> _T:
        """Wait until ``predicate()`` returns something truthy (re-checked on every event)."""
        async with asyncio.timeout(timeout):
            while True:
                result = predicate()
                if result:
                    return result
                await self._changed.wait()

    async def wait_streams(self, count: int, timeout: float = 5.0) -> StreamRecord:
        """Wait until ``count`` streams were opened; return the latest."""
        return await self.wait_for(
            lambda: self.streams[-1] if len(self.streams) >= count else None, timeout
        )

    async def wait_response(self, nonce: str, timeout: float = 5.0) -> XdsRequestRecord:
        """The client's ACK or NACK of the response with ``nonce``."""

        def find() -> XdsRequestRecord | None:
            for r in self.requests:
                if r.request.response_nonce == nonce:
                    return r
            return None

        return await self.wait_for(find, timeout)

    async def wait_answered(self, stream: StreamRecord, timeout: float = 5.0) -> None:
        """Wait until ``stream`` has ACKed or NACKed every response sent to it so far."""

        def answered() -> bool:
            sent = self._sent.get(stream.id, set())
            acked = {r.response_nonce for r in stream.requests if r.response_nonce}
            return bool(sent) and sent <= acked

        await self.wait_for(answered, timeout)

    def acks(self) -> list[XdsRequestRecord]:
        return [r for r in self.requests if r.is_ack]

    def nacks(self) -> list[XdsRequestRecord]:
        return [r for r in self.requests if r.is_nack]

    # -- gRPC plumbing --------------------------------------------------------------------------

    def __mapping__(self) -> dict[str, Handler]:
        return {
            _ADS_PATH: Handler(
                self._delta_ads,
                Cardinality.STREAM_STREAM,
                ds.DeltaDiscoveryRequest,
                ds.DeltaDiscoveryResponse,
            ),
            _CA_PATH: Handler(
                self._create_certificate,
                Cardinality.UNARY_UNARY,
                ca_pb2.IstioCertificateRequest,
                ca_pb2.IstioCertificateResponse,
            ),
        }

    def _check_token(self, metadata: list[tuple[str, str]]) -> None:
        if self.accept_tokens is None:
            return
        auth = next((v for k, v in metadata if k == "authorization"), "")
        if not auth.startswith("Bearer ") or auth[len("Bearer ") :] not in self.accept_tokens:
            raise GRPCError(Status.UNAUTHENTICATED, "fake istiod: bad or missing bearer token")

    async def _delta_ads(
        self, stream: Stream[ds.DeltaDiscoveryRequest, ds.DeltaDiscoveryResponse]
    ) -> None:
        metadata = [(k, str(v)) for k, v in stream.metadata.items()] if stream.metadata else []
        record = StreamRecord(next(self._stream_ids), metadata)
        self.streams.append(record)
        self._notify()
        try:
            if self.refuse_streams > 0:
                self.refuse_streams -= 1
                raise GRPCError(self.refuse_status, "fake istiod: stream refused")
            self._check_token(metadata)
            live = _LiveStream(record)
            self._live.add(live)
            reader = asyncio.get_running_loop().create_task(self._read_requests(stream, live))
            try:
                await self._write_responses(stream, live)
            finally:
                self._live.discard(live)
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        finally:
            record.closed = True
            self._notify()

    async def _read_requests(
        self, stream: Stream[ds.DeltaDiscoveryRequest, ds.DeltaDiscoveryResponse], live: _LiveStream
    ) -> None:
        try:
            async for req in stream:
                live.record.requests.append(req)
                self.requests.append(XdsRequestRecord(live.record.id, req))
                self._on_request(live, req)
                self._notify()
        finally:
            live.queue.put_nowait(_End())

    def _on_request(self, live: _LiveStream, req: ds.DeltaDiscoveryRequest) -> None:
        type_url = req.type_url
        if req.response_nonce:
            return  # an ACK or NACK: recorded, nothing to send
        if type_url not in self._resources:
            return
        first = type_url not in live.subscriptions
        sub, unsub = set(req.resource_names_subscribe), set(req.resource_names_unsubscribe)
        names = live.subscriptions.get(type_url)
        if first:
            names = None if not sub else set()  # an empty first subscription is a wildcard
        if names is not None:
            names |= sub - {"*"}
            names -= unsub
            if "*" in sub and "*" not in unsub:
                names = None
        live.subscriptions[type_url] = names
        table = self._resources[type_url]
        if names is not None and type_url == ADDRESS_TYPE_URL:
            self._on_demand(live, req, sub, names)
            return
        resp = ds.DeltaDiscoveryResponse(type_url=type_url)
        known = dict(req.initial_resource_versions) if first else {}
        wanted = sorted(table) if names is None else sorted(sub & set(table))
        for name in wanted:
            stored = table[name]
            if known.get(name) != stored.version:
                self._add_resource(resp, name, stored)
        resp.removed_resources.extend(sorted(n for n in known if n not in table))
        if first or resp.resources or resp.removed_resources:
            self._send(live, resp)

    def _on_demand(
        self,
        live: _LiveStream,
        req: ds.DeltaDiscoveryRequest,
        sub: set[str],
        names: set[str],
    ) -> None:
        """Answer a non-wildcard (on-demand) Address request as istiod's WorkloadGenerator
        (generateDeltasOndemand, AdditionalPodSubscriptions) does: each requested name may be a
        resource name or an alias (``<network>/<ip>`` of a workload or a service VIP); a match
        is sent under its own name with the alias in ``aliases``; a service brings the workloads
        behind it; the workloads on the proxy's node (NODE_NAME metadata) are always sent;
        requested names that match nothing come back in ``removed_resources``. The stream is
        then subscribed to everything it was sent, so later changes are pushed."""
        table = self._resources[ADDRESS_TYPE_URL]
        decoded: dict[str, wl_pb.Address] = {}
        for name, stored in table.items():
            if stored.payload is None:
                continue
            pb = wl_pb.Address()
            try:
                stored.payload.Unpack(pb)
            except Exception:
                continue
            decoded[name] = pb
        aliases: dict[str, set[str]] = {}  # alias -> resource names
        for name, pb in decoded.items():
            for alias in _aliases(pb):
                aliases.setdefault(alias, set()).add(name)
        send: dict[str, list[str]] = {}  # resource name -> aliases it answers
        missing: list[str] = []
        for want in sorted(sub - {"*"}):
            hits = {want} if want in decoded else aliases.get(want, set())
            if not hits:
                missing.append(want)
                continue
            for name in hits:
                send.setdefault(name, [])
                if name != want:
                    send[name].append(want)
        # Pods behind a requested or subscribed service (AdditionalPodSubscriptions).
        services = {n for n in [*send, *names] if n in decoded and decoded[n].HasField("service")}
        node = _stream_node(live)
        for name, pb in decoded.items():
            if not pb.HasField("workload"):
                continue
            w = pb.workload
            in_service = any(k in services for k in w.services)
            node_local = bool(node) and w.node == node and name not in names
            if in_service or node_local:
                send.setdefault(name, [])
        names |= set(send)
        resp = ds.DeltaDiscoveryResponse(type_url=ADDRESS_TYPE_URL)
        for name in sorted(send):
            self._add_resource(resp, name, table[name])
            resp.resources[-1].aliases.extend(send[name])
        resp.removed_resources.extend(missing)
        self._send(live, resp)

    async def _write_responses(
        self, stream: Stream[ds.DeltaDiscoveryRequest, ds.DeltaDiscoveryResponse], live: _LiveStream
    ) -> None:
        while True:
            item = await live.queue.get()
            if isinstance(item, _End):
                return
            if isinstance(item, _Fail):
                raise GRPCError(item.status, item.message)
            if self.response_delay:
                await asyncio.sleep(self.response_delay)
            await stream.send_message(item)
            self._sent.setdefault(live.record.id, set()).add(item.nonce)

    async def _create_certificate(
        self, stream: Stream[ca_pb2.IstioCertificateRequest, ca_pb2.IstioCertificateResponse]
    ) -> None:
        metadata = [(k, str(v)) for k, v in stream.metadata.items()] if stream.metadata else []
        req = await stream.recv_message()
        assert req is not None
        signed: Identity | None = None
        try:
            self._check_token(metadata)
            if self.ca_delay:
                await asyncio.sleep(self.ca_delay)
            if self.ca_unavailable or self.ca_fail_next > 0:
                self.ca_fail_next = max(0, self.ca_fail_next - 1)
                raise GRPCError(Status.UNAVAILABLE, "fake istiod: CA unavailable")
            impersonated = None
            if req.HasField("metadata") and "ImpersonatedIdentity" in req.metadata.fields:
                impersonated = Identity.parse(
                    req.metadata.fields["ImpersonatedIdentity"].string_value
                )
            target = self.ca_wrong_identity or impersonated
            ttl = dt.timedelta(seconds=req.validity_duration) if req.validity_duration > 0 else None
            try:
                chain = self.ca.sign_csr(req.csr, ttl=ttl, identity=target)
            except ValueError as e:
                raise GRPCError(Status.INVALID_ARGUMENT, f"fake istiod: bad CSR: {e}") from None
            signed = target
            if signed is None:
                signed = first_identity(load_pem_certificates(chain[0])[0])
            if self.ca_chain_transform is not None:
                chain = self.ca_chain_transform(chain)
            await stream.send_message(ca_pb2.IstioCertificateResponse(cert_chain=chain))
        finally:
            self.csrs.append(CsrRecord(req, metadata, signed))
            self._notify()
