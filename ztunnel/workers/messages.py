"""What the supervisor and its workers say to each other (pickled over ``ipc.Channel``).

Supervisor -> worker:
    Hello             the config, the log levels in force and the shared state store's path
                      (the worker maps it read-only); first message
    StateChanged      what a commit to the shared store changed, in commit order
    Cert / CertGone   a certificate for an identity a worker asked for (also every renewal) /
                      the identity left the node
    AddPod            a pod's (or the dedicated proxy's) listening sockets, and its netns, as fds
    RemovePod         stop serving it (drain for ``deadline`` seconds), then Reply
    Query             "metrics" | "live" | "stats" | "connections" | "recycle" | "profile",
                      then Reply
    Retire            a fresh worker took this one's place (workers/recycle.py): stop
                      accepting, let the connections finish, then Reply; its pods stay until
                      then (a RemovePod still drains one with its deadline)
    Demanded          an on-demand xDS fetch the worker asked for has been answered
    SetLogLevel       a /logging change
    Sync              answered with Ready once everything sent before it is applied (the
                      state snapshot and the pods after a worker starts)
(The supervisor stops a worker by closing its channel, once every pod was removed or, retired,
once it answered.)

Worker -> supervisor:
    Ready             the answer to Sync; carries the pid
    CertRequest       an identity the worker needs a certificate for
    Demand            XDS_ON_DEMAND: fetch this resource name
    Reply             the answer to a request id
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ztunnel.config import Config, WorkloadInfo
from ztunnel.core.identity import Identity
from ztunnel.proxy.sockets import ListenKey

# A state change: ("workload" | "service" | "policy", key, removed, the store's id for it).
StateChangeTuple = tuple[str, str, bool, int]
# A certificate as DER: (PKCS#8 key, leaf, intermediates, roots).
CertBundle = tuple[bytes, bytes, tuple[bytes, ...], tuple[bytes, ...]]


@dataclass(frozen=True, slots=True)
class Hello:
    config: Config
    log_spec: str
    store: str


@dataclass(frozen=True, slots=True)
class StateChanged:
    changes: list[StateChangeTuple]


@dataclass(frozen=True, slots=True)
class Cert:
    identity: Identity
    bundle: CertBundle | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CertGone:
    identity: Identity


@dataclass(frozen=True, slots=True)
class AddPod:
    """fds: the netns first when ``has_netns``, then one per ``keys`` entry."""

    key: int
    name: str
    info: WorkloadInfo
    keys: tuple[ListenKey, ...]
    has_netns: bool


@dataclass(frozen=True, slots=True)
class RemovePod:
    key: int
    deadline: float | None  # (None: no limit)
    request: int


@dataclass(frozen=True, slots=True)
class Retire:
    request: int


@dataclass(frozen=True, slots=True)
class Query:
    what: str  # "metrics" | "live" | "stats" | "connections" | "recycle" | "profile" (args:
    # seconds, frequency)
    request: int
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Demanded:
    request: int


@dataclass(frozen=True, slots=True)
class SetLogLevel:
    spec: str


@dataclass(frozen=True, slots=True)
class Sync:
    pass


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int


@dataclass(frozen=True, slots=True)
class CertRequest:
    identity: Identity


@dataclass(frozen=True, slots=True)
class Demand:
    name: str
    request: int


@dataclass(frozen=True, slots=True)
class Reply:
    request: int
    value: Any


@dataclass(frozen=True, slots=True)
class ConnectionSnapshot:
    """A live connection as a worker reports it (what /config_dump's ``workloadState`` and
    /debug/connections read from a ``ConnectionRecord``); ``row_id`` is stable for its life."""

    row_id: str
    direction: str
    src: Any
    dst: Any
    orig_dst: Any
    for_host: str | None
    hbone_addr: Any
    mtls: bool
    double_hbone: bool
    src_identity: Identity | None
    dst_identity: Identity | None
    src_workload: Any
    dst_workload: Any
    dst_service: Any
    started: float
    sent: int
    recv: int

    def live_bytes(self) -> tuple[int, int]:
        return self.sent, self.recv
