"""Workloads, services and policies, indexed for the per-connection lookups, in the shared store.

The State is a view of one :class:`~ztunnel.state.shared.SharedStore`: the node's only copy of
the mesh state, an LMDB environment. The supervisor's State is the writer (xDS, the local
config); each data-plane worker's State maps the same store read-only and is told what changed
(:meth:`State.apply_changes`), so no worker holds a replica. With one process, its State is
both. Lookups decode the compact records (``state/records.py``) into model objects, kept in
small per-process caches.

Invariants:

- A writer's changes are made in a transaction (:meth:`State.batch`; a single change outside
  one is its own), committed at the end: readers, and subscribers, see all of it or none of it.
  A failed batch (the store is full) leaves the state as it was.
- Every lookup reads one consistent snapshot: the writer's open transaction while a batch is
  being written (its own changes), else the last snapshot this process was told about.
- Per-connection work depends neither on the size of the mesh nor on a service's size: every
  lookup is an index lookup, and load balancing picks from a table built once per change of a
  service's endpoints (Rust's ``load_balance`` walks every endpoint on every connection).

Nothing here does I/O beyond the memory-mapped store, and nothing awaits; the async layer
(``fetch_*``/``wait_for_*``) sits on top and learns about changes through :meth:`State.subscribe`.
Lookup and load-balancing rules follow istio/ztunnel ``src/state.rs`` and ``src/state/*.rs``.
"""

from __future__ import annotations

import array
import asyncio
import bisect
import contextlib
import enum
import functools
import hashlib
import ipaddress
import itertools
import marshal
import pickle
import random
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lmdb

from ztunnel.core.addr import IPAddr
from ztunnel.state.model import (
    Authorization,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    NetworkAddress,
    NetworkCidr,
    NetworkMode,
    PolicyScope,
    Service,
    ServiceVisibility,
    TunnelProtocol,
    Workload,
    WorkloadStatus,
)
from ztunnel.state.records import (
    W_ADDRS,
    W_CLUSTER,
    W_HOSTNAME,
    W_LOCALITY,
    W_NAME,
    W_NETGW,
    W_NETMODE,
    W_NETWORK,
    W_NODE,
    W_NS,
    W_SA,
    W_SERVICES,
    W_STATUS,
    W_TUNNEL,
    W_UID,
    decode_service,
    decode_workload,
    service_from_tuple,
    service_ids,
    service_tuple,
    workload_from_tuple,
    workload_ids,
    workload_tuple,
)
from ztunnel.state.shared import (
    DEFAULT_MAP_SIZE,
    PRIVATE_MAP_SIZE,
    SharedStore,
    StoreError,
    StoreFull,
    ip_key,
    pack_i,
    pack_q,
    prefix_scan,
    unpack_i,
    unpack_q,
)

__all__ = [
    "ChangeKind",
    "State",
    "StateChange",
    "StoreError",
    "StoreFull",
    "Subscriber",
    "pick_workload_ip",
]


class ChangeKind(enum.Enum):
    WORKLOAD = "workload"
    SERVICE = "service"
    POLICY = "policy"
    # Any workload or service may have changed: a commit too big to name them one by one
    # (:func:`summarize`). A reader forgets every workload and service it decoded.
    MANY = "many"


@dataclass(frozen=True, slots=True)
class StateChange:
    """One mutation: ``key`` is the workload uid, the service ``ns/hostname`` or policy ``ns/name``;
    ``ref`` the store's id for it (workload id, service key id; 0 for policies)."""

    kind: ChangeKind
    key: str
    removed: bool = False
    ref: int = field(default=0, compare=False)


Subscriber = Callable[[StateChange], None]

# Past this many workload and service changes, a commit is told to readers as one MANY change
# (a snapshot of 200k pods would cost every worker a 13 MiB message and half a second of CPU;
# a 1% delta of it, 4,000 changes, is still named one by one).
SUMMARY_THRESHOLD = 8192


def summarize(changes: list[StateChange], threshold: int = SUMMARY_THRESHOLD) -> list[StateChange]:
    """What readers are told of a commit: ``changes`` itself, or, past ``threshold`` workload
    and service changes, one MANY change followed by the policy changes (policies are compiled
    one by one: their subscribers need each key)."""
    if len(changes) <= threshold:
        return changes
    policies = [c for c in changes if c.kind is ChangeKind.POLICY]
    if len(changes) - len(policies) <= threshold:
        return changes
    return [StateChange(ChangeKind.MANY, ""), *policies]


CommitListener = Callable[[list[StateChange]], None]

_NO_PORTS: dict[int, int] = {}
# Strings that are part of keys (uids, names, hostnames, policy keys) are limited: LMDB keys are
# at most 511 bytes. Longer ones are refused (the resource is NACKed), never truncated.
MAX_NAME_BYTES = 320
_CACHE_WORKLOADS = 4096
_CACHE_SERVICES = 2048
_CACHE_POLICIES = 1024
_CACHE_STRINGS = 32768
_CACHE_PICKS = 2048  # pick tables (as many as services: a table per service and port, mostly)
_CACHE_PICK_ENDPOINTS = 65536  # endpoints in all of them (about 40 bytes each)
_CACHE_ADDRESSES = 4096

# An endpoint's summary, kept in the ``ep`` index beside its workload id: what load balancing
# filters and ranks by, so a pick table is built without decoding any workload.
_EP_UNHEALTHY, _EP_CAPACITY, _EP_ADDRLESS, _EP_NETWORK, _EP_GATEWAY, _EP_TUNNEL, _EP_PORTS = range(
    7
)
_EP_REGION, _EP_ZONE, _EP_SUBZONE, _EP_NODE, _EP_CLUSTER = range(7, 12)

# A service's ``eppick`` entry, written by the writer once per commit that changed its
# endpoints: its healthy endpoints in ``ep`` order with their capacities, what ``load_balance``
# picks from in the common case (no locality ranking, unhealthy ones dropped, the service's
# port mapped), so a reader builds that table from one record instead of decoding every
# endpoint's summary (5,000 endpoints: a few µs instead of milliseconds, in every worker).
# One flag byte, then n workload ids ("q") and n capacities ("I"), native order.
_PLAIN_ADDRLESS = 1  # an address-less endpoint: the source's network decides, so no plain table
_PLAIN_UNEVEN = 2  # some capacity is not 1
_PLAIN_WID_BYTES = array.array("q").itemsize
# Building an entry reads every endpoint of the service, once per commit that changed them. A
# service this big that changes again sooner than _PLAIN_EVERY seconds loses its entry instead
# (readers scan its endpoints, as they would without one) until a commit at least that much
# later builds it again: what a stream of tiny xDS responses costs stays bounded.
_PLAIN_BIG = 512
_PLAIN_EVERY = 0.1


def visible_to(service: Service, client_namespace: str) -> bool:
    """Rust ``Service::visible_to``: a NAMESPACE-scoped service is seen only from its own
    namespace; every other service from everywhere."""
    return service.visibility is not ServiceVisibility.NAMESPACE or (
        service.namespace == client_namespace
    )


def find_best_match(
    services: Iterable[Service],
    client_namespace: str | None,
    preferred_namespace: str | None = None,
) -> Service | None:
    """Rust ``ServiceMatch::find_best_match`` over services sharing a key (VIP or hostname), in
    insertion order: one in the client's namespace at once; else the last ``canonical`` one;
    else the last one in ``preferred_namespace`` seen before any canonical one; else the first.
    """
    best: Service | None = None
    rank = 0  # 0 none, 1 first, 2 preferred namespace, 3 canonical
    for s in services:
        if client_namespace is not None and s.namespace == client_namespace:
            return s
        if s.canonical:
            best, rank = s, 3
        elif preferred_namespace is not None and s.namespace == preferred_namespace and rank != 3:
            best, rank = s, 2
        elif rank == 0:
            best, rank = s, 1
    return best


def _addr_rank(w: Workload) -> int:
    # Rust WorkloadByAddr::get: when several workloads claim one IP, prefer Pods (hard to spoof),
    # then mesh (HBONE) workloads.
    return (2 if "//Pod/" in w.uid else 0) + (1 if w.protocol is TunnelProtocol.HBONE else 0)


def pick_workload_ip(
    workload: Workload, original_dst: IPAddr, ip_families: IPFamilies = IPFamilies.AUTOMATIC
) -> IPAddr | None:
    """The IP to dial on ``workload`` (Rust ``pick_workload_destination_or_resolve``): the
    original destination when it is one of the workload's IPs; else, among the IPs the
    service's ``ip_families`` allows (AUTOMATIC and DUAL: all), the first of the original
    destination's family, else the first. None: no usable IP (the caller resolves the
    workload's hostname or goes through its network gateway)."""
    ips = workload.addresses
    if original_dst in ips:
        return original_dst
    if ip_families is IPFamilies.IPV4_ONLY:
        ips = tuple(ip for ip in ips if ip.version == 4)
    elif ip_families is IPFamilies.IPV6_ONLY:
        ips = tuple(ip for ip in ips if ip.version == 6)
    want = original_dst.version
    for ip in ips:
        if ip.version == want:
            return ip
    return ips[0] if ips else None


def _skey(s: str) -> bytes:
    """A string as a key of the string table or the policy table: its UTF-8, or for one too
    long for a key, 0xFF (never in UTF-8) and its SHA-256."""
    raw = s.encode()
    if len(raw) <= MAX_NAME_BYTES:
        return raw
    return b"\xff" + hashlib.sha256(raw).digest()


def _lp(s: str) -> bytes:
    """A string inside a composite key: its length, then its UTF-8 (no separator to forge)."""
    raw = s.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"name too long ({len(raw)} bytes, at most {MAX_NAME_BYTES}): {s[:64]!r}…")
    return len(raw).to_bytes(2, "big") + raw


def _check_name(what: str, s: str) -> None:
    if len(s) * 4 > MAX_NAME_BYTES and len(s.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"{what} too long (at most {MAX_NAME_BYTES} bytes): {s[:64]!r}…")


_HOST_NETWORK = NetworkMode.HOST_NETWORK.value
_UNHEALTHY = WorkloadStatus.UNHEALTHY.value
_S_NS, _S_HOSTNAME, _S_VIPS, _S_CIDRS = 1, 2, 3, 10  # positions in a service record


def _summary(t: tuple[Any, ...], ports: tuple[tuple[int, int], ...]) -> bytes:
    """A workload record's ``ep`` entry for one of its services (see ``_EP_*``)."""
    loc = t[W_LOCALITY]
    cap = t[-1]
    return marshal.dumps(
        (
            t[W_STATUS] == _UNHEALTHY,
            cap if cap > 0 else 0,
            not t[W_ADDRS] and not t[W_HOSTNAME],
            t[W_NETWORK],
            t[W_NETGW] is not None,
            t[W_TUNNEL] is not None,
            tuple([p for p, _ in ports]),
            loc[0],
            loc[1],
            loc[2],
            t[W_NODE],
            t[W_CLUSTER],
        )
    )


class _PickTable:
    """A service's usable endpoints for one (port, source locality), with their weights: what
    :meth:`State.load_balance` picks from in O(1) (O(log n) with uneven capacities)."""

    __slots__ = ("cumulative", "serial", "total", "version", "wids")

    def __init__(self, version: bytes | None, wids: list[int], weights: list[int]) -> None:
        self.version = version
        self.serial = -1  # the State's snapshot serial it was last checked at
        self.wids = wids
        self.total = 0
        self.cumulative: list[int] | None = None
        if any(w != 1 for w in weights):
            acc = 0
            cum = []
            keep = []
            for wid, w in zip(wids, weights, strict=True):
                if w > 0:
                    acc += w
                    cum.append(acc)
                    keep.append(wid)
            self.wids, self.cumulative, self.total = keep, cum, acc
        else:
            self.total = len(wids)

    @classmethod
    def plain(cls, version: bytes | None, raw: bytes) -> _PickTable | None:
        """The table of an ``eppick`` entry, as ``__init__`` would make it from the same
        endpoints; None when the entry cannot stand for it (an address-less endpoint)."""
        flags = raw[0]
        if flags & _PLAIN_ADDRLESS:
            return None
        n = (len(raw) - 1) // (_PLAIN_WID_BYTES + 4)
        ids = array.array("q")
        ids.frombytes(raw[1 : 1 + n * _PLAIN_WID_BYTES])
        table = cls.__new__(cls)
        table.version = version
        table.serial = -1
        if flags & _PLAIN_UNEVEN:
            caps = array.array("I")
            caps.frombytes(raw[1 + n * _PLAIN_WID_BYTES :])
            table.wids = list(itertools.compress(ids, caps))
            table.cumulative = list(itertools.accumulate(filter(None, caps)))
            table.total = table.cumulative[-1] if table.cumulative else 0
        else:
            table.wids = ids.tolist()
            table.cumulative = None
            table.total = n
        return table

    def pick(self, rng: random.Random) -> int | None:
        if self.total == 0:
            return None  # Rust choose_weighted fails on a zero total
        if self.cumulative is None:
            n = len(self.wids)
            return self.wids[0] if n == 1 else self.wids[rng.randrange(n)]
        return self.wids[bisect.bisect_right(self.cumulative, rng.randrange(self.total))]


def _evict_oldest(cache: dict[Any, Any]) -> list[Any]:
    """Make room in a full cache: its oldest quarter goes (a cache cleared whole when full
    holds half its size on average; a service with more endpoints than the cache then misses
    most of its picks). Returns the values dropped."""
    return [cache.pop(k) for k in list(itertools.islice(cache, len(cache) // 4 + 1))]


class _Missing(dict[Any, Any]):
    """A dict that fills a missing key from ``load`` (which stores it): a cache whose hits cost
    a plain dict read, where the decoders look up every string of a record."""

    __slots__ = ("_load",)

    def __init__(self, load: Callable[[Any], Any], initial: dict[Any, Any]) -> None:
        super().__init__(initial)
        self._load = load

    def __missing__(self, key: Any) -> Any:
        return self._load(key)


class _Batch:
    """The context manager of :meth:`State.batch` (one per State: the depth is the State's)."""

    __slots__ = ("_state",)

    def __init__(self, state: State) -> None:
        self._state = state

    def __enter__(self) -> None:
        self._state._begin()

    def __exit__(self, et: object, exc: BaseException | None, tb: object) -> None:
        self._state._end(exc)


class State:
    """Workloads, services and authorization policies, indexed for the per-connection lookups.

    ``State()`` makes a private store of its own (tests, ``ztunnel explain``), removed with the
    State; ``State(store=...)`` views a shared one (the supervisor's, or a worker's read-only
    mapping of it: :meth:`open`)."""

    __slots__ = (
        "__weakref__",
        "_batch",
        "_by_addr",
        "_by_vip",
        "_changes",
        "_cidrs",
        "_commit_listeners",
        "_counters",
        "_cur",
        "_depth",
        "_ep_dirty",
        "_failed",
        "_generation",
        "_ids",
        "_intern",
        "_kids",
        "_memo",
        "_pick_endpoints",
        "_picks",
        "_plain_at",
        "_plain_stale",
        "_pols",
        "_rng",
        "_rtxn",
        "_serial",
        "_store",
        "_str",
        "_str_delta",
        "_str_drop",
        "_strs",
        "_subscribers",
        "_svcs",
        "_wl_waiters",
        "_wls",
        "_wtxn",
        "demander",
    )

    def __init__(
        self, rng: random.Random | None = None, *, store: SharedStore | None = None
    ) -> None:
        self._rng = rng if rng is not None else random.Random()
        if store is None:
            store = SharedStore.create(map_size=PRIVATE_MAP_SIZE)
            weakref.finalize(self, store.close)
        self._store = store
        self._rtxn: Any = store.env.begin()
        self._wtxn: Any = None
        self._cur: dict[str, Any] = {}  # a cursor per database, in the transaction read now
        self._open_cursors()
        self._depth = 0
        self._failed = False  # a change of the open batch failed: it will be aborted
        self._batch = _Batch(self)
        self._changes: list[StateChange] = []  # of the open batch
        # String id -> references added / dropped by the open batch (Counter.update counts in C).
        self._str_delta: Counter[int] = Counter()
        self._str_drop: Counter[int] = Counter()
        self._ep_dirty: set[int] = set()  # services whose endpoints the open batch changed
        # (writer) big services: when their eppick entry was built; those that lost it
        self._plain_at: dict[int, float] = {}
        self._plain_stale: set[int] = set()
        self._counters = {"wid": 0, "seq": 0, "str": 1}
        # String id -> string (ids are never reused), and string -> id (the writer's): lookups
        # that hit are plain dict reads, a miss goes to the store (``__missing__``).
        self._strs = _Missing(self._load_str, {0: ""})
        self._ids = _Missing(self._new_id, {"": 0})
        self._str = self._strs.__getitem__
        self._intern = self._ids.__getitem__
        self._wls: dict[int, Workload] = {}
        self._svcs: dict[int, Service] = {}
        self._pols: dict[str, Authorization | None] = {}
        self._picks: dict[tuple[Any, ...], _PickTable] = {}
        self._pick_endpoints = 0  # in the tables of _picks
        self._cidrs: list[tuple[NetworkCidr, int]] | None = None  # (read once per snapshot)
        # What the per-connection lookups answered in this snapshot (forgotten with it): the
        # workload at an address, the best service at a VIP for a client namespace.
        self._by_addr: dict[tuple[str, IPAddr], Workload | None] = {}
        self._by_vip: dict[tuple[str, IPAddr, str | None], Service | None] = {}
        # Bumped whenever lookups start reading another snapshot (a renew, a batch opened):
        # what was validated against the store at one serial holds until the next.
        self._serial = 0
        # service key -> its string id, for the services decoded here (the id of a service's
        # key is fixed while the service exists; every change to it is notified).
        self._kids: dict[str, int] = {}
        self._memo: dict[Any, Any] = {}  # shared small values for the decoders
        self._subscribers: list[Subscriber] = []
        self._commit_listeners: list[CommitListener] = []
        # (namespace, service account) -> resolved at the next upsert of a workload with that
        # identity: what connections waiting for their own pod's workload await (one future
        # shared by every waiter of the identity).
        self._wl_waiters: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._generation = 0
        # XDS_ON_DEMAND: asks the control plane for one resource name (a workload uid, a
        # "ns/hostname" or "<network>/<ip>") and returns once it answered (Rust Demander).
        self.demander: Callable[[str], Awaitable[None]] | None = None

    @classmethod
    def open(
        cls, path: str, *, map_size: int = DEFAULT_MAP_SIZE, rng: random.Random | None = None
    ) -> State:
        """A read-only view of the shared store another process writes (a data-plane worker);
        ``map_size`` is the writer's (ZTUNNEL_STATE_MAX_BYTES)."""
        return cls(rng, store=SharedStore.open(path, map_size=map_size))

    @property
    def store(self) -> SharedStore:
        return self._store

    def close(self) -> None:
        """Release the snapshot (and, for a private store, the store)."""
        if self._wtxn is not None:
            self._wtxn.abort()
            self._wtxn = None
        with contextlib.suppress(lmdb.Error):
            self._rtxn.abort()
        self._cur.clear()

    # --- transactions ----------------------------------------------------------------------

    def _open_cursors(self) -> None:
        """A cursor on every database, in the transaction lookups read now (``_cur``)."""
        txn = self._wtxn if self._wtxn is not None else self._rtxn
        self._cur = {name: txn.cursor(db=db) for name, db in self._store.dbs.items()}

    def _renew(self) -> None:
        """Read the newest committed snapshot from now on."""
        self._rtxn.abort()
        self._cur = {}
        env = self._store.env
        try:
            self._rtxn = env.begin()
        except lmdb.MapResizedError:  # (a reader mapped less than the writer now uses)
            env.set_mapsize(0)
            self._rtxn = env.begin()
        self._open_cursors()
        self._new_snapshot()

    def _new_snapshot(self) -> None:
        """Lookups read another snapshot from now on: what was read from the last one is
        checked again (``_serial``) or forgotten."""
        self._serial += 1
        self._cidrs = None
        self._by_addr.clear()
        self._by_vip.clear()

    def batch(self) -> _Batch:
        """``with state.batch():`` applies every change made inside as one transaction:
        readers and subscribers see all of it at the end, or none of it if anything raised (a
        full store: :class:`StoreFull`). Batches nest (the outermost commits)."""
        return self._batch

    def _begin(self) -> None:
        if not self._store.writer:
            raise StoreError("this State is a read-only view of the shared store")
        if self._depth == 0:
            self._failed = False
            try:
                self._wtxn = self._store.env.begin(write=True)
            except lmdb.Error as e:
                raise StoreError(f"cannot write to the state store: {e}") from None
            self._open_cursors()
            self._new_snapshot()
        elif self._failed:  # (an inner change failed: the transaction can only be aborted)
            raise StoreFull(self._full_message())
        self._depth += 1

    def _end(self, exc: BaseException | None) -> None:
        self._depth -= 1
        if isinstance(exc, lmdb.Error):
            self._failed = True
        if self._depth:
            if isinstance(exc, lmdb.Error):
                raise self._store_error(exc) from None
            return
        if exc is not None or self._failed:
            self._abort()
            if isinstance(exc, lmdb.Error) or (exc is None and self._failed):
                raise self._store_error(exc) from None
            return
        self._commit()

    def _full_message(self) -> str:
        return f"the state does not fit in the store ({self._store.map_size() >> 20} MiB)"

    def _store_error(self, exc: BaseException | None) -> StoreError:
        if exc is None or isinstance(exc, lmdb.MapFullError):
            return StoreFull(self._full_message())
        return StoreError(f"the state store failed: {exc}")

    def _abort(self) -> None:
        self._wtxn.abort()
        self._wtxn = None
        self._changes = []
        self._str_delta = Counter()
        self._str_drop = Counter()
        self._ep_dirty = set()
        self._reset_caches()  # (they may hold what the aborted transaction wrote)
        # (The counters stay where the aborted batch left them: ids are never reused.)
        self._renew()

    def _commit(self) -> None:
        txn = self._wtxn
        try:
            # The endpoint sets that changed: their version once per batch (what readers
            # check their pick tables against).
            epver = self._cur["epver"]
            for kid in self._ep_dirty:
                self._bump(epver, pack_i(kid))
            self._update_plain(self._ep_dirty)
            self._ep_dirty = set()
            self._apply_string_refs()
            txn.commit()
        except lmdb.Error as e:
            self._abort()
            raise self._store_error(e) from None
        except BaseException:
            self._abort()
            raise
        self._wtxn = None
        self._renew()
        changes, self._changes = self._changes, []
        if changes:
            self._changed(changes, invalidate=False)  # (its caches followed the batch)
            for listener in tuple(self._commit_listeners):
                listener(changes)

    def on_commit(self, listener: CommitListener) -> Callable[[], None]:
        """Call ``listener`` with every committed batch's changes (the supervisor tells its
        workers). Returns an unsubscribe function."""
        self._commit_listeners.append(listener)
        return lambda: self._commit_listeners.remove(listener)

    def apply_changes(self, changes: Iterable[StateChange]) -> None:
        """A reader: the writer committed these changes; read the new snapshot, forget what they
        invalidate and tell the subscribers."""
        self._renew()
        self._changed(list(changes))

    def _changed(self, changes: list[StateChange], *, invalidate: bool = True) -> None:
        if invalidate:
            wls, svcs, pols = self._wls, self._svcs, self._pols
            kids = self._kids
            for ch in changes:
                if ch.kind is ChangeKind.WORKLOAD:
                    wls.pop(ch.ref, None)
                elif ch.kind is ChangeKind.SERVICE:
                    svcs.pop(ch.ref, None)
                    kids.pop(ch.key, None)
                elif ch.kind is ChangeKind.POLICY:
                    pols.pop(ch.key, None)
                else:
                    wls.clear()
                    svcs.clear()
                    kids.clear()
        self._generation += len(changes)
        if self._wl_waiters:
            self._wake_waiters(changes)
        if self._subscribers:
            subs = tuple(self._subscribers)
            for ch in changes:
                for cb in subs:
                    cb(ch)

    def _reset_caches(self) -> None:
        self._wls.clear()
        self._svcs.clear()
        self._kids.clear()
        self._pols.clear()
        self._picks.clear()
        self._pick_endpoints = 0
        self._cidrs = None
        self._by_addr.clear()
        self._by_vip.clear()
        if self._store.writer:  # (a string of an aborted batch may be gone)
            self._ids.clear()
            self._ids[""] = 0
            self._strs.clear()
            self._strs[0] = ""

    # --- change notification -----------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Bumped on every change this process saw; a cheap "did anything change" check."""
        return self._generation

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` for every change once it is committed (or, in a reader, applied),
        with the state already showing it; returns an unsubscribe function. An exception from
        one propagates to the committer (the change itself is already complete)."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    # --- the string table ------------------------------------------------------------------

    def _load_str(self, i: int) -> str:
        """A string missing from the cache (``_strs``): read from the store, cached."""
        raw = self._cur["str"].get(pack_i(i))
        if raw is None:
            raise StoreError(f"string {i} missing from the store")
        s: str = raw.decode()
        strs = self._strs
        if len(strs) >= _CACHE_STRINGS:
            strs.clear()
            strs[0] = ""
        strs[i] = s
        return s

    def _id(self, s: str) -> int | None:
        """The id of ``s`` in the string table, None if it is not there (no count taken). Only
        the writer caches these: it alone knows when a string leaves the table (and a string
        added again gets a new id)."""
        if not s:
            return 0
        writer = self._store.writer
        if writer:
            cached: int | None = self._ids.get(s)
            if cached is not None:
                return cached
        raw = self._cur["strid"].get(_skey(s))
        if raw is None:
            return None
        i: int = unpack_i(raw)[0]
        if writer:
            ids = self._ids
            if len(ids) >= _CACHE_STRINGS:
                ids.clear()
                ids[""] = 0
            ids[s] = i
        return i

    def _new_id(self, s: str) -> int:
        """A string missing from the writer's cache (``_ids``): its id, adding it to the table
        if needed (no reference counted: whoever stores a record counts the ids it holds,
        :meth:`_hold`)."""
        i = self._id(s)
        if i is None:
            i = self._counters["str"]
            self._counters["str"] = i + 1
            self._cur["strid"].put(_skey(s), pack_i(i) + pack_i(0))
            self._cur["str"].put(pack_i(i), s.encode())
            self._ids[s] = i
            self._str_delta[i] += 0  # (seen at commit: dropped there if nothing holds it)
        return i

    def _hold(self, ids: Iterable[int]) -> None:
        self._str_delta.update(ids)

    def _release(self, ids: Iterable[int]) -> None:
        self._str_drop.update(ids)

    def _apply_string_refs(self) -> None:
        """At commit: the reference counts of the strings the batch touched; a string nothing
        refers to any more leaves the table (its id is never reused)."""
        delta = self._str_delta
        delta.subtract(self._str_drop)
        self._str_drop = Counter()
        self._str_delta = Counter()
        delta.pop(0, None)
        if not delta:
            return
        c_id, c_str = self._cur["strid"], self._cur["str"]
        for i, d in delta.items():
            raw_s = c_str.get(pack_i(i))
            if raw_s is None:
                continue
            text = raw_s.decode()
            k = _skey(text)
            raw = c_id.get(k)
            if raw is None:
                continue
            refs = unpack_i(raw, 4)[0] + d
            if refs <= 0:
                c_id.delete()
                if c_str.set_key(pack_i(i)):
                    c_str.delete()
                self._ids.pop(text, None)
                self._strs.pop(i, None)
            elif d:
                c_id.put(k, pack_i(i) + pack_i(refs))

    def _next(self, name: str) -> int:
        n = self._counters[name] + 1
        self._counters[name] = n
        return n

    # --- workloads -------------------------------------------------------------------------

    def _workload(self, wid: int) -> Workload | None:
        w = self._wls.get(wid)
        if w is None:
            raw = self._cur["wl"].get(pack_q(wid))
            if raw is None:
                return None
            w = decode_workload(raw[8:], self._str, self._memo)
            if len(self._wls) >= _CACHE_WORKLOADS:
                _evict_oldest(self._wls)
            self._wls[wid] = w
        return w

    def _wid(self, uid: str) -> int | None:
        raw = self._cur["wluid"].get(_skey(uid))
        return None if raw is None else unpack_q(raw)[0]

    @property
    def interner(self) -> Callable[[str], int]:
        """The writer's string table: a string's id, adding it (what records are built with,
        e.g. ``xds.convert.workload_record``). A string nothing holds at commit is dropped."""
        return self._intern

    def upsert_workload(self, w: Workload) -> None:
        _check_name("workload hostname", w.hostname)
        for key in w.services:
            _check_name("service key", key)
        with self._batch:
            self.upsert_workload_record(workload_tuple(w, self._intern))
            wid = self._changes[-1].ref
            if len(self._wls) >= _CACHE_WORKLOADS:
                _evict_oldest(self._wls)
            self._wls[wid] = w  # (the caller's object: no decode for its next lookup)

    def upsert_workload_record(self, t: tuple[Any, ...]) -> None:
        """A workload as its record, built with :attr:`interner` (``records.workload_tuple``,
        or straight from xDS)."""
        _check_name("workload uid", t[W_UID])
        _check_name("workload name", t[W_NAME])
        with self._batch:
            c = self._cur["wl"]
            # A new uid (the common case: a snapshot) is one write; a known one, one failed
            # write that leaves the cursor on its id.
            by_uid = self._cur["wluid"]
            wid = self._counters["wid"] + 1
            if by_uid.put(_skey(t[W_UID]), pack_q(wid), overwrite=False):
                self._counters["wid"] = wid
            else:
                wid = unpack_q(by_uid.value())[0]
                raw = c.get(pack_q(wid))
                assert raw is not None
                old = marshal.loads(raw[8:])
                self._unindex_workload(old, wid, unpack_q(raw)[0])
                self._release(workload_ids(old))
                self._wls.pop(wid, None)
            seq = self._next("seq")
            self._hold(workload_ids(t))
            c.put(pack_q(wid), pack_q(seq) + marshal.dumps(t))
            self._index_workload(t, wid, seq)
            self._changes.append(StateChange(ChangeKind.WORKLOAD, t[W_UID], False, wid))

    def remove_workload(self, uid: str) -> Workload | None:
        if len(uid.encode()) > MAX_NAME_BYTES:
            return None
        with self._batch:
            wid = self._wid(uid)
            if wid is None:
                return None
            c = self._cur["wl"]
            raw = c.get(pack_q(wid))
            assert raw is not None
            t = marshal.loads(raw[8:])
            old = self._wls.pop(wid, None) or workload_from_tuple(t, self._str, self._memo)
            self._unindex_workload(t, wid, unpack_q(raw)[0])
            self._release(workload_ids(t))
            if c.set_key(pack_q(wid)):
                c.delete()
            self._cur["wluid"].delete(_skey(uid))
            self._changes.append(StateChange(ChangeKind.WORKLOAD, uid, True, wid))
            return old

    @staticmethod
    def _workload_keys(t: tuple[Any, ...]) -> list[tuple[str, bytes]]:
        """The keys of a workload record in the list-valued indexes (database, key): each
        holds the ids of the workloads with that key, in upsert order."""
        ns = pack_i(t[W_NS])
        out = []
        # Host-network workloads share the node IP: indexing it would shadow the node (Rust
        # skips them too).
        if t[W_NETMODE] != _HOST_NETWORK:
            net = t[W_NETWORK]
            out += [("addr", ip_key(net, packed)) for packed in t[W_ADDRS]]
        out.append(("info", ns + _lp(t[W_NAME])))
        if t[W_HOSTNAME]:
            out.append(("wlhost", pack_i(t[W_HOSTNAME])))
        return out

    def _index_workload(self, t: tuple[Any, ...], wid: int, seq: int) -> None:
        value = pack_q(wid)
        for db, k in self._workload_keys(t):
            _list_add(self._cur[db], k, value)
        s = pack_q(seq)
        self._cur["ident"].put(pack_i(t[W_NS]) + pack_i(t[W_SA]) + pack_i(t[W_NODE]) + s, value)
        services = t[W_SERVICES]
        if services:
            ep, dirty = self._cur["ep"], self._ep_dirty
            for kid, ports in services:
                ep.put(pack_i(kid) + s, value + _summary(t, ports))
                dirty.add(kid)

    def _unindex_workload(self, t: tuple[Any, ...], wid: int, seq: int) -> None:
        value = pack_q(wid)
        for db, k in self._workload_keys(t):
            _list_remove(self._cur[db], k, value)
        s = pack_q(seq)
        c = self._cur["ident"]
        if c.set_key(pack_i(t[W_NS]) + pack_i(t[W_SA]) + pack_i(t[W_NODE]) + s):
            c.delete()
        services = t[W_SERVICES]
        if services:
            ep, dirty = self._cur["ep"], self._ep_dirty
            for kid, _ in services:
                if ep.set_key(pack_i(kid) + s):
                    ep.delete()
                dirty.add(kid)

    def _update_plain(self, dirty: set[int]) -> None:
        """The ``eppick`` entries of the services whose endpoints this batch changed, and of
        the big ones that lost theirs (``_PLAIN_BIG``) and may have them again."""
        plain, at, stale = self._cur["eppick"], self._plain_at, self._plain_stale
        now = time.monotonic()
        for kid in dirty | stale:
            key = pack_i(kid)
            last = at.get(kid)
            if last is not None and now - last < _PLAIN_EVERY:
                if kid in dirty:
                    if plain.set_key(key):
                        plain.delete()
                    stale.add(kid)
                continue
            stale.discard(kid)
            entry, rows = self._plain_entry(kid)
            if rows >= _PLAIN_BIG:
                at[kid] = now
            else:
                at.pop(kid, None)
            if entry is not None:
                plain.put(key, entry)
            elif plain.set_key(key):
                plain.delete()

    def _plain_entry(self, kid: int) -> tuple[bytes | None, int]:
        """The ``eppick`` entry of service ``kid`` (see ``_PLAIN_*``; None: no endpoints) and
        how many endpoints it has."""
        ids, caps = array.array("q"), array.array("I")
        flags = 0
        rows = 0
        for _, v in prefix_scan(self._cur["ep"], pack_i(kid)):
            rows += 1
            e = marshal.loads(v[8:])
            if e[_EP_ADDRLESS]:
                flags |= _PLAIN_ADDRLESS
                continue
            if e[_EP_UNHEALTHY]:
                continue
            cap = e[_EP_CAPACITY]
            if cap != 1:
                flags |= _PLAIN_UNEVEN
            ids.append(unpack_q(v)[0])
            caps.append(cap)
        if not rows:
            return None, 0
        if flags & _PLAIN_ADDRLESS:
            return bytes([_PLAIN_ADDRLESS]), rows
        return bytes([flags]) + ids.tobytes() + caps.tobytes(), rows

    @staticmethod
    def _bump(cursor: Any, key: bytes) -> None:
        raw = cursor.get(key)
        cursor.put(key, pack_q((unpack_q(raw)[0] if raw else 0) + 1))

    def _wids_at(self, db: str, key: bytes) -> list[int]:
        raw = self._cur[db].get(key)
        if raw is None:
            return []
        if len(raw) == 8:
            return [unpack_q(raw)[0]]
        return [unpack_q(raw, i)[0] for i in range(0, len(raw), 8)]

    def find_workload_by_uid(self, uid: str) -> Workload | None:
        if len(uid.encode()) > MAX_NAME_BYTES:
            return None
        wid = self._wid(uid)
        return None if wid is None else self._workload(wid)

    def find_workload_by_addr(self, addr: NetworkAddress) -> Workload | None:
        key = (addr.network, addr.address)
        memo = self._by_addr
        if key in memo:
            return memo[key]
        found: Workload | None = self._remember(memo, key, self._find_workload_by_addr(addr))
        return found

    def _remember(self, memo: dict[Any, Any], key: Any, found: Any) -> Any:
        """``found`` for ``key`` in an address memo (bounded: a client probing addresses
        clears it, never grows it), unless a batch is open (it may still change it)."""
        if self._wtxn is None:
            if len(memo) >= _CACHE_ADDRESSES:
                memo.clear()
            memo[key] = found
        return found

    def _find_workload_by_addr(self, addr: NetworkAddress) -> Workload | None:
        # Exact: ::ffff:a.b.c.d is not a.b.c.d here (Rust keys by IpAddr; sockets canonicalise).
        net = self._id(addr.network)
        if net is None:
            return None
        wids = self._wids_at("addr", ip_key(net, addr.address.packed))
        if not wids:
            return None
        if len(wids) == 1:
            return self._workload(wids[0])
        best: Workload | None = None
        best_rank = -1
        for wid in wids:
            w = self._workload(wid)
            if w is None:
                continue
            r = _addr_rank(w)
            if r >= best_rank:  # ties go to the later one, as Rust's max_by_key does
                best, best_rank = w, r
        return best

    def find_workload_by_info(
        self, name: str, namespace: str, service_account: str, node: str | None = None
    ) -> Workload | None:
        """The workload a ZDS WorkloadInfo describes (name, namespace, SA), optionally on ``node``.

        Several matches can only come from bad config; the earliest inserted wins.
        """
        ns = self._id(namespace)
        if ns is None or len(name.encode()) > MAX_NAME_BYTES:
            return None
        for wid in self._wids_at("info", pack_i(ns) + _lp(name)):
            w = self._workload(wid)
            if (
                w is not None
                and w.service_account == service_account
                and (node is None or w.node == node)
            ):
                return w
        return None

    async def wait_for_workload(
        self,
        name: str,
        namespace: str,
        service_account: str,
        node: str | None,
        timeout: float,
    ) -> Workload | None:
        """Rust ``DemandProxyState::wait_for_workload``: :meth:`find_workload_by_info`, and
        while it is unknown (a pod handed over before istiod sent its workload), wait for it up
        to ``timeout`` seconds, then give up (None). Woken by upserts of that identity only."""
        found = self.find_workload_by_info(name, namespace, service_account, node)
        if found is not None or timeout <= 0:
            return found
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key = (namespace, service_account)
        while (remaining := deadline - loop.time()) > 0:
            fut = self._wl_waiters.get(key)
            if fut is None or fut.done():
                fut = self._wl_waiters[key] = loop.create_future()
            await asyncio.wait((fut,), timeout=remaining)  # (never cancels the shared future)
            found = self.find_workload_by_info(name, namespace, service_account, node)
            if found is not None:
                return found
        return None

    def _wake_waiters(self, changes: list[StateChange]) -> None:
        for ch in changes:
            if ch.kind is ChangeKind.MANY:  # (any may have come: each waiter looks again)
                waiters, self._wl_waiters = self._wl_waiters, {}
                for waiter in waiters.values():
                    if not waiter.done():
                        waiter.set_result(None)
                return
            if ch.kind is not ChangeKind.WORKLOAD or ch.removed:
                continue
            w = self.find_workload_by_uid(ch.key)
            if w is None:
                continue
            fut = self._wl_waiters.pop((w.namespace, w.service_account), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
            if not self._wl_waiters:
                return

    def find_workload_by_hostname(
        self, hostname: str, namespace: str | None = None
    ) -> Workload | None:
        hid = self._id(hostname) if hostname else None
        if hid is None:
            return None
        for wid in self._wids_at("wlhost", pack_i(hid)):
            w = self._workload(wid)
            if w is not None and (namespace is None or w.namespace == namespace):
                return w
        return None

    def workloads(self) -> Iterator[Workload]:
        """Every workload (decoded one by one: for dumps and tools, not per connection)."""
        lookup, memo = self._str, self._memo
        for _, raw in _everything(self._cur["wl"]):
            yield decode_workload(raw[8:], lookup, memo)

    def identity_on_node(self, namespace: str, service_account: str, node: str) -> bool:
        """Whether any workload with this identity remains on ``node`` ("" = any node): the
        test behind Rust ``WorkloadStore::was_last_identity_on_node`` (which, like this,
        ignores the trust domain)."""
        ns, sa = self._id(namespace), self._id(service_account)
        if ns is None or sa is None:
            return False
        prefix = pack_i(ns) + pack_i(sa)
        if node:
            nid = self._id(node)
            if nid is None:
                return False
            prefix += pack_i(nid)
        return next(prefix_scan(self._cur["ident"], prefix), None) is not None

    # --- services --------------------------------------------------------------------------

    def _service(self, kid: int) -> Service | None:
        s = self._svcs.get(kid)
        if s is None:
            raw = self._cur["svc"].get(pack_i(kid))
            if raw is None:
                return None
            s = decode_service(raw[8:], self._str, self._memo)
            if len(self._svcs) >= _CACHE_SERVICES:
                self._svcs.clear()
                self._kids.clear()
            self._svcs[kid] = s
            self._kids[s.key] = kid
        return s

    def _kid(self, key: str) -> int | None:
        """The id of a service key (cached for the services decoded here)."""
        kid = self._kids.get(key)
        if kid is None and len(key.encode()) <= MAX_NAME_BYTES:
            kid = self._id(key)
        return kid

    def upsert_service(self, s: Service) -> None:
        key = s.key
        _check_name("service key", key)
        _check_name("service hostname", s.hostname)
        with self._batch:
            c = self._cur["svc"]
            kid = self._id(key)
            if kid is not None:
                raw = c.get(pack_i(kid))
                if raw is not None:
                    old = marshal.loads(raw[8:])
                    self._unindex_service(old, kid)
                    self._release(service_ids(old))
                    self._release((kid,))
            kid = self._intern(key)
            seq = self._next("seq")
            t = service_tuple(s, self._intern)
            self._hold(service_ids(t))
            self._hold((kid,))
            c.put(pack_i(kid), pack_q(seq) + marshal.dumps(t))
            self._index_service(t, kid)
            if len(self._svcs) >= _CACHE_SERVICES:
                self._svcs.clear()
            self._svcs[kid] = s
            self._kids[key] = kid
            self._changes.append(StateChange(ChangeKind.SERVICE, key, False, kid))

    def remove_service(self, key: str) -> Service | None:
        if len(key.encode()) > MAX_NAME_BYTES:
            return None
        with self._batch:
            kid = self._id(key)
            if kid is None:
                return None
            c = self._cur["svc"]
            raw = c.get(pack_i(kid))
            if raw is None:
                return None
            t = marshal.loads(raw[8:])
            old = self._svcs.pop(kid, None) or service_from_tuple(t, self._str, self._memo)
            self._kids.pop(key, None)
            if c.set_key(pack_i(kid)):
                c.delete()
            self._unindex_service(t, kid)
            self._release(service_ids(t))
            self._release((kid,))
            self._changes.append(StateChange(ChangeKind.SERVICE, key, True, kid))
            return old

    @staticmethod
    def _slot_keys(t: tuple[Any, ...]) -> list[tuple[str, bytes]]:
        """The keys of a service record in the VIP and hostname indexes: each holds one slot
        per namespace, (namespace id, service key id), in insertion order, as Rust's
        ServiceStore keeps them (a list replaced per namespace)."""
        out = [("vip", ip_key(net, packed)) for net, packed in t[_S_VIPS]]
        out.append(("host", pack_i(t[_S_HOSTNAME])))
        return out

    def _index_service(self, t: tuple[Any, ...], kid: int) -> None:
        ns, value = pack_i(t[_S_NS]), pack_i(kid)
        for db, key in self._slot_keys(t):
            c = self._cur[db]
            raw = c.get(key) or b""
            for i in range(0, len(raw), 8):
                if raw[i : i + 4] == ns:  # the namespace's slot, overwritten in place
                    c.put(key, raw[: i + 4] + value + raw[i + 8 :])
                    break
            else:
                c.put(key, raw + ns + value)  # a new slot, last in order
        cidrs = t[_S_CIDRS]
        if cidrs:
            c = self._cur["cidr"]
            for net, (packed, plen) in cidrs:
                c.put(pack_q(self._next("seq")), value + pack_i(net) + bytes((plen,)) + packed)
            self._cidrs = None

    def _unindex_service(self, t: tuple[Any, ...], kid: int) -> None:
        ns = pack_i(t[_S_NS])
        for db, key in self._slot_keys(t):
            # Rust ServiceStore::remove drops the namespace's slot, whoever holds it now.
            c = self._cur[db]
            raw = c.get(key)
            if raw is None:
                continue
            kept = b"".join(raw[i : i + 8] for i in range(0, len(raw), 8) if raw[i : i + 4] != ns)
            if kept:
                c.put(key, kept)
            elif c.set_key(key):
                c.delete()
        if t[_S_CIDRS]:
            c = self._cur["cidr"]
            mine = [k for k, v in _everything(c) if unpack_i(v)[0] == kid]
            for k in mine:
                if c.set_key(k):
                    c.delete()
            self._cidrs = None

    def find_service(self, key: str) -> Service | None:
        """Exact lookup by ``"ns/hostname"``."""
        if len(key.encode()) > MAX_NAME_BYTES:
            return None
        kid = self._id(key)
        return None if kid is None else self._service(kid)

    def _services_at(self, db: str, key: bytes) -> list[Service]:
        """The services in the slots of ``key`` (a VIP or a hostname), in slot order."""
        raw = self._cur[db].get(key)
        if raw is None:
            return []
        out = []
        for i in range(4, len(raw), 8):
            svc = self._service(unpack_i(raw, i)[0])
            if svc is not None:
                out.append(svc)
        return out

    def find_services_by_vip(self, addr: NetworkAddress) -> list[Service]:
        """Every service holding ``addr`` as an exact VIP, in insertion order."""
        net = self._id(addr.network)
        if net is None:
            return []
        return self._services_at("vip", ip_key(net, addr.address.packed))

    def find_service_by_vip(
        self, addr: NetworkAddress, namespace: str | None = None
    ) -> Service | None:
        """Rust ``ServiceStore::get_best_by_vip``: among the services on this exact VIP that
        are visible to a client in ``namespace`` (None: no filter), the best match
        (:func:`find_best_match`); else the best CIDR VIP containing it."""
        key = (addr.network, addr.address, namespace)
        memo = self._by_vip
        if key in memo:
            return memo[key]
        found: Service | None = self._remember(
            memo, key, self._find_service_by_vip(addr, namespace)
        )
        return found

    def _find_service_by_vip(self, addr: NetworkAddress, namespace: str | None) -> Service | None:
        slots = self.find_services_by_vip(addr)
        if slots:
            if len(slots) == 1 and namespace is None:
                return slots[0]
            cands: Iterable[Service] = slots
            if namespace is not None:
                cands = [s for s in cands if visible_to(s, namespace)]
            best = find_best_match(cands, namespace)
            if best is not None:
                return best
        cidrs = self._cidr_list()
        if cidrs:
            return self._best_by_cidr_vip(cidrs, addr, namespace)
        return None

    def _cidr_list(self) -> list[tuple[NetworkCidr, int]]:
        """The CIDR VIPs, in insertion order (few: read whole, once per snapshot)."""
        if self._cidrs is not None:
            return self._cidrs
        out: list[tuple[NetworkCidr, int]] = []
        for _, v in _everything(self._cur["cidr"]):
            kid, net, plen = unpack_i(v)[0], unpack_i(v, 4)[0], v[8]
            packed = bytes(v[9:])
            cidr = (
                ipaddress.IPv4Network((packed, plen))
                if len(packed) == 4
                else ipaddress.IPv6Network((packed, plen))
            )
            out.append((NetworkCidr(self._str(net), cidr), kid))
        self._cidrs = out
        return out

    def _best_by_cidr_vip(
        self, cidrs: list[tuple[NetworkCidr, int]], addr: NetworkAddress, namespace: str | None
    ) -> Service | None:
        """Rust ``get_best_by_cidr_vip``: rank (client's namespace, prefix length, canonical),
        the first of equal rank winning."""
        best: Service | None = None
        best_rank: tuple[bool, int, bool] | None = None
        ip = addr.address
        for nc, kid in cidrs:
            if nc.network != addr.network or ip.version != nc.cidr.version or ip not in nc.cidr:
                continue
            svc = self._service(kid)
            if svc is None:
                continue
            if namespace is not None and not visible_to(svc, namespace):
                continue
            rank = (
                namespace is not None and svc.namespace == namespace,
                nc.cidr.prefixlen,
                svc.canonical,
            )
            if best_rank is None or rank > best_rank:
                best, best_rank = svc, rank
        return best

    def find_services_by_hostname(self, hostname: str) -> list[Service]:
        """All services with this hostname, one per namespace, ordered by namespace."""
        hid = self._id(hostname) if hostname else None
        if hid is None:
            return []
        found = self._services_at("host", pack_i(hid))
        return sorted(found, key=lambda s: s.namespace)

    def find_service_by_hostname(
        self,
        hostname: str,
        prefer_namespace: str | None = None,
        *,
        preferred_namespace: str | None = None,
    ) -> Service | None:
        """Rust ``ServiceStore::get_best_by_host``: among same-hostname services (ServiceEntry
        allows one per namespace) visible to a client in ``prefer_namespace`` (None: no
        filter), the client's namespace, else the last ``canonical`` one, else one in
        ``preferred_namespace`` (PREFERED_SERVICE_NAMESPACE), else the first inserted."""
        hid = self._id(hostname) if hostname else None
        if hid is None:
            return None
        cands: Iterable[Service] = self._services_at("host", pack_i(hid))
        if prefer_namespace is not None:
            cands = [s for s in cands if visible_to(s, prefer_namespace)]
        return find_best_match(cands, prefer_namespace, preferred_namespace)

    def services(self) -> Iterator[Service]:
        lookup, memo = self._str, self._memo
        for _, raw in _everything(self._cur["svc"]):
            yield decode_service(raw[8:], lookup, memo)

    def services_for(self, workload: Workload) -> list[Service]:
        """The known services this workload is an endpoint of."""
        return [s for k in workload.services if (s := self.find_service(k)) is not None]

    # --- mixed lookups -----------------------------------------------------------------------

    def find_address(
        self, addr: NetworkAddress, namespace: str | None = None
    ) -> Workload | Service | None:
        """Workload or service at ``addr``. A workload IP wins over a service VIP, as in Rust
        ``ProxyState::find_address`` (outbound routing checks VIPs first itself: use
        :meth:`find_service_by_vip` then :meth:`find_workload_by_addr` for that). ``namespace``
        is the client's, for VIPs shared by several services and visibility."""
        w = self.find_workload_by_addr(addr)
        if w is not None:
            return w
        return self.find_service_by_vip(addr, namespace)

    async def fetch_address(
        self, addr: NetworkAddress, namespace: str | None = None
    ) -> Workload | Service | None:
        """:meth:`find_address`, asking the control plane for ``"<network>/<ip>"`` first when
        it is unknown and on-demand xDS is on (Rust ``DemandProxyState::fetch_address``)."""
        found = self.find_address(addr, namespace)
        if found is not None or self.demander is None:
            return found
        await self.demander(str(addr))
        return self.find_address(addr, namespace)

    async def fetch_workload_by_uid(self, uid: str) -> Workload | None:
        """Rust ``fetch_workload_by_uid``: the uid, on demand when unknown."""
        found = self.find_workload_by_uid(uid)
        if found is not None or self.demander is None:
            return found
        await self.demander(uid)
        return self.find_workload_by_uid(uid)

    def find_hostname(self, namespace: str, hostname: str) -> Workload | Service | None:
        """Service ``namespace/hostname``, else a workload with that hostname in the namespace."""
        s = self.find_service(f"{namespace}/{hostname}")
        if s is not None:
            return s
        return self.find_workload_by_hostname(hostname, namespace)

    def find_gateway(
        self, gw: GatewayAddress, namespace: str | None = None
    ) -> Workload | Service | None:
        """Resolve a waypoint/network-gateway reference to what it names; ``namespace`` is the
        client's (a VIP shared by several services, visibility: Rust find_upstream)."""
        if gw.address is not None:
            return self.find_address(gw.address, namespace)
        if gw.hostname is not None:
            return self.find_hostname(gw.hostname.namespace, gw.hostname.hostname)
        return None

    # --- endpoints and load balancing ----------------------------------------------------------

    def _endpoint_wids(self, service: Service) -> list[int]:
        kid = self._id(service.key) if len(service.key.encode()) <= MAX_NAME_BYTES else None
        if kid is None:
            return []
        return [unpack_q(v)[0] for _, v in prefix_scan(self._cur["ep"], pack_i(kid))]

    def endpoints(self, service: Service) -> list[Workload]:
        """Workloads listing ``service`` in their ``services`` map (healthy or not). Decodes
        every one: for DNS answers, dumps and tools; connections use :meth:`load_balance`."""
        return [w for wid in self._endpoint_wids(service) if (w := self._workload(wid))]

    def has_endpoint(self, service: Service, workload: Workload) -> bool:
        """Whether ``workload`` lists ``service`` (Rust ``Service::contains_endpoint``)."""
        wid = self._wid(workload.uid) if len(workload.uid.encode()) <= MAX_NAME_BYTES else None
        kid = self._id(service.key) if len(service.key.encode()) <= MAX_NAME_BYTES else None
        if wid is None or kid is None:
            return False
        raw = self._cur["wl"].get(pack_q(wid))
        return raw is not None and self._cur["ep"].set_key(pack_i(kid) + raw[:8])

    def endpoint_target_port(
        self, service: Service, workload: Workload, service_port: int
    ) -> int | None:
        """The port to dial on ``workload`` for ``service:service_port`` (Rust
        ``find_upstream_from_service``): the endpoint's own mapping, else the service's
        non-zero target port, else the service port itself when the workload has an application
        tunnel port; None means the endpoint cannot serve this port.

        A service target port of 0 means "named port, resolved per endpoint" (istiod sends 0
        when the Kubernetes targetPort is a name), so it never falls back to the service port.
        """
        ov = workload.services.get(service.key)
        if ov is not None:
            p = ov.get(service_port)
            if p is not None:
                return p
        for sp in service.ports:
            if sp.service_port == service_port:
                if sp.target_port > 0:
                    return sp.target_port
                break
        tunnel = workload.application_tunnel
        if tunnel is not None and tunnel.port is not None:
            return service_port
        return None

    def load_balance(
        self,
        service: Service,
        service_port: int,
        source: Workload | None,
        rng: random.Random | None = None,
        *,
        for_waypoint: bool = False,
    ) -> tuple[Workload, int] | None:
        """Pick an endpoint of ``service`` for a connection to ``service_port``; returns the
        workload and the target port to dial, or None ("no healthy upstream").

        Mirrors Rust ``ProxyState::load_balance``:

        1. the service must expose the port (waypoint resolution skips this: a waypoint is
           addressed as ``svc:15008`` and app-tunnel endpoints need no port);
        2. UNHEALTHY endpoints are dropped unless ``health_policy`` is ALLOW_ALL;
        3. an endpoint with neither IPs nor hostname is usable only through its network gateway
           from another network;
        4. with a service target port of 0 the endpoint must map the port itself;
        5. in STRICT/FAILOVER (any mode but Standard) endpoints are ranked by leading
           ``routing_preference`` matches against ``source``; STRICT keeps full matches only,
           and only the best rank survives;
        6. a random pick weighted by ``capacity`` (0 never picked; all zero -> None).

        Steps 1-5 make a table, built once per change of the service's endpoints and per
        (port, source locality), so a pick costs the same for 1 endpoint or 5,000.

        ``source`` None (no local workload) compares networks against "" and ranks every
        endpoint 0. PASSTHROUGH services are the caller's business: it should not call this.
        """
        svc_target: int | None = None
        for sp in service.ports:
            if sp.service_port == service_port:
                svc_target = sp.target_port
                break
        if svc_target is None and not for_waypoint:
            return None
        kid = self._kid(service.key)
        if kid is None:
            return None
        lb = service.load_balancing
        ranked = lb is not None and lb.mode is not LoadBalancerMode.UNSPECIFIED
        src_key: tuple[str, ...] | None
        if source is None:
            src_key = None
        elif ranked:
            loc = source.locality
            src_key = (
                source.network,
                loc.region,
                loc.zone,
                loc.subzone,
                source.node,
                source.cluster_id,
            )
        else:
            src_key = (source.network,)
        tkey = (kid, service_port, for_waypoint, svc_target, lb, src_key)
        table = self._picks.get(tkey)
        if table is None or table.serial != self._serial:
            # (Once per snapshot: is it still the table of the service's endpoints?)
            version = self._cur["epver"].get(pack_i(kid))
            if table is None or table.version != version:
                plain = (  # (the writer's table stands for the common case: _plain_table)
                    svc_target  # (else each endpoint's own ports decide)
                    and not for_waypoint
                    and not ranked
                    and (lb is None or lb.health_policy is not HealthPolicy.ALLOW_ALL)
                )
                table = (self._plain_table(kid, version) if plain else None) or self._pick_table(
                    kid, version, service_port, svc_target, lb, source, for_waypoint
                )
                if self._wtxn is None:  # (an open batch's tables would outlive what it shows)
                    self._keep_table(tkey, table)
            table.serial = self._serial
        wid = table.pick(rng if rng is not None else self._rng)
        if wid is None:
            return None
        chosen = self._workload(wid)
        if chosen is None:
            return None
        port = self.endpoint_target_port(service, chosen, service_port)
        if port is None:  # only reachable in waypoint mode, and Rust gives up here too
            return None
        return chosen, port

    def _keep_table(self, tkey: tuple[Any, ...], table: _PickTable) -> None:
        """Cache ``table``, making room by dropping the oldest quarter of the tables until both
        bounds hold (a node that talks to more services than the cache holds keeps most of its
        tables, where clearing it whole made every table be rebuilt; the newest table is kept
        even if it alone is over the endpoint bound: rebuilding it per connection costs more)."""
        picks = self._picks
        old = picks.pop(tkey, None)
        if old is not None:
            self._pick_endpoints -= len(old.wids)
        size = len(table.wids)
        while picks and (
            len(picks) >= _CACHE_PICKS or self._pick_endpoints + size > _CACHE_PICK_ENDPOINTS
        ):
            for dropped in _evict_oldest(picks):
                self._pick_endpoints -= len(dropped.wids)
        picks[tkey] = table
        self._pick_endpoints += size

    def _plain_table(self, kid: int, version: bytes | None) -> _PickTable | None:
        """Service ``kid``'s table from the writer's ``eppick`` entry, or None (no entry, or
        one that cannot stand for it). Not inside an open batch: its endpoints are not in
        eppick yet."""
        if self._wtxn is not None:
            return None
        raw = self._cur["eppick"].get(pack_i(kid))
        return None if raw is None else _PickTable.plain(version, raw)

    def _pick_table(
        self,
        kid: int,
        version: bytes | None,
        service_port: int,
        svc_target: int | None,
        lb: LoadBalancing | None,
        source: Workload | None,
        for_waypoint: bool,
    ) -> _PickTable:
        """The table from every endpoint's summary: any port, source, mode and policy."""
        allow_unhealthy = lb is not None and lb.health_policy is HealthPolicy.ALLOW_ALL
        src_network = source.network if source is not None else ""
        lookup = self._str
        cands: list[tuple[int, Any]] = []
        for _, v in prefix_scan(self._cur["ep"], pack_i(kid)):
            e = marshal.loads(v[8:])
            if e[_EP_UNHEALTHY] and not allow_unhealthy:
                continue
            # WDS is client-agnostic: an address-less workload comes with a network gateway
            # even when it is on our own network, where the gateway must not be used.
            if e[_EP_ADDRLESS] and (lookup(e[_EP_NETWORK]) == src_network or not e[_EP_GATEWAY]):
                continue
            if for_waypoint:
                if svc_target is None and not e[_EP_TUNNEL]:
                    continue
            elif not svc_target and service_port not in e[_EP_PORTS]:
                continue
            cands.append((unpack_q(v)[0], e))
        if lb is not None and lb.mode is not LoadBalancerMode.UNSPECIFIED and cands:
            cands = self._rank(cands, lb, source)
        return _PickTable(version, [wid for wid, _ in cands], [e[_EP_CAPACITY] for _, e in cands])

    def _rank(
        self, cands: list[tuple[int, Any]], lb: LoadBalancing, source: Workload | None
    ) -> list[tuple[int, Any]]:
        """Keep the endpoints with the best locality rank (Rust ``load_balance``, non-Standard
        modes).

        The rank is the number of leading ``routing_preference`` scopes that match the source; the
        first mismatch stops the count. STRICT drops any endpoint that does not match them all.
        When NETWORK is the first preference ("network preferred"), a network mismatch does not
        stop the count (the other scopes are still tried) and a network match is worth
        ``len(prefs) - 1`` extra, so any same-network endpoint outranks every other-network one.
        """
        prefs = lb.routing_preference
        strict = lb.mode is LoadBalancerMode.STRICT
        network_preferred = bool(prefs) and prefs[0] is LoadBalancerScope.NETWORK
        lookup = self._str
        mine: dict[LoadBalancerScope, str] = {}
        if source is not None:
            loc = source.locality
            mine = {
                LoadBalancerScope.REGION: loc.region,
                LoadBalancerScope.ZONE: loc.zone,
                LoadBalancerScope.SUBZONE: loc.subzone,
                LoadBalancerScope.NODE: source.node,
                LoadBalancerScope.CLUSTER: source.cluster_id,
                LoadBalancerScope.NETWORK: source.network,
            }
        field_of = {
            LoadBalancerScope.REGION: _EP_REGION,
            LoadBalancerScope.ZONE: _EP_ZONE,
            LoadBalancerScope.SUBZONE: _EP_SUBZONE,
            LoadBalancerScope.NODE: _EP_NODE,
            LoadBalancerScope.CLUSTER: _EP_CLUSTER,
            LoadBalancerScope.NETWORK: _EP_NETWORK,
        }
        best = -1
        out: list[tuple[int, Any]] = []
        for wid, e in cands:
            rank = 0
            adjust = 0
            if source is not None:  # no source: nothing to compare against, every endpoint ranks 0
                for scope in prefs:
                    f = field_of.get(scope)
                    # UNSPECIFIED: Rust rejects it at conversion; never a match here.
                    matches = f is not None and lookup(e[f]) == mine[scope]
                    if scope is LoadBalancerScope.NETWORK and network_preferred:
                        if not matches:
                            continue
                        adjust = len(prefs) - 1
                    elif not matches:
                        break
                    rank += 1
            if strict and rank != len(prefs):
                continue
            rank += adjust
            if rank > best:
                best, out = rank, [(wid, e)]
            elif rank == best:
                out.append((wid, e))
        return out

    # --- policies ------------------------------------------------------------------------------

    def upsert_policy(self, p: Authorization) -> None:
        key = p.key
        _check_name("policy key", key)
        _check_name("policy namespace", p.namespace)
        with self._batch:
            c = self._cur["pol"]
            k = _skey(key)
            raw = c.get(k)
            if raw is not None:
                old = self._pols.get(key) or pickle.loads(raw[8:])
                self._unindex_policy(old, unpack_q(raw)[0])
            seq = self._next("seq")
            c.put(k, pack_q(seq) + pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL))
            ns = self._policy_index_ns(p)
            if ns is not None:
                self._cur["polns"].put(_lp(ns) + pack_q(seq), key.encode())
            self._pols[key] = p
            self._changes.append(StateChange(ChangeKind.POLICY, key, False))

    def remove_policy(self, key: str) -> Authorization | None:
        if len(key.encode()) > MAX_NAME_BYTES:
            return None
        with self._batch:
            c = self._cur["pol"]
            raw = c.get(_skey(key))
            if raw is None:
                return None
            c.delete()
            old: Authorization = self._pols.get(key) or pickle.loads(raw[8:])
            self._unindex_policy(old, unpack_q(raw)[0])
            self._pols.pop(key, None)
            self._changes.append(StateChange(ChangeKind.POLICY, key, True))
            return old

    @staticmethod
    def _policy_index_ns(p: Authorization) -> str | None:
        # GLOBAL policies live in the root namespace but apply everywhere: index them under "".
        # WORKLOAD_SELECTOR policies apply only via Workload.authorization_policies.
        if p.scope is PolicyScope.GLOBAL:
            return ""
        if p.scope is PolicyScope.NAMESPACE:
            return p.namespace
        return None

    def _unindex_policy(self, p: Authorization, seq: int) -> None:
        ns = self._policy_index_ns(p)
        if ns is not None:
            c = self._cur["polns"]
            if c.set_key(_lp(ns) + pack_q(seq)):
                c.delete()

    def find_policy(self, key: str) -> Authorization | None:
        if key in self._pols:
            return self._pols[key]
        if len(key.encode()) > MAX_NAME_BYTES:
            return None
        raw = self._cur["pol"].get(_skey(key))
        p: Authorization | None = None if raw is None else pickle.loads(raw[8:])
        if len(self._pols) >= _CACHE_POLICIES:
            self._pols.clear()
        self._pols[key] = p
        return p

    def policies(self) -> Iterator[Authorization]:
        for _, raw in _everything(self._cur["pol"]):
            yield pickle.loads(raw[8:])

    def policies_for(self, workload: Workload) -> list[Authorization]:
        """Policies that apply to ``workload`` as a destination: its namespace's, the global
        ones, then those its ``authorization_policies`` names; each once, unknown keys skipped
        (the control plane may not have sent them yet)."""
        out: list[Authorization] = []
        seen: set[str] = set()

        def in_ns(ns: str) -> list[str]:
            if len(ns.encode()) > MAX_NAME_BYTES:
                return []
            return [v.decode() for _, v in prefix_scan(self._cur["polns"], _lp(ns))]

        groups: tuple[Iterable[str], ...] = (
            in_ns(workload.namespace),
            in_ns("") if workload.namespace != "" else (),
            workload.authorization_policies,
        )
        for keys in groups:
            for k in keys:
                if k in seen:
                    continue
                p = self.find_policy(k)
                if p is not None:
                    seen.add(k)
                    out.append(p)
        return out

    # --- bulk ----------------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove everything, notifying subscribers of each removal."""
        with self._batch:
            for w in list(self.workloads()):
                self.remove_workload(w.uid)
            for s in list(self.services()):
                self.remove_service(s.key)
            for p in list(self.policies()):
                self.remove_policy(p.key)

    def store_sizes(self) -> dict[str, int]:
        """Bytes of the store: pages in use, its data file, its limit."""
        st = self._store
        return {"used": st.used_bytes(), "file": st.file_bytes(), "limit": st.map_size()}

    def counts(self) -> dict[str, int]:
        """How many workloads, services and policies the store holds."""
        txn = self._wtxn if self._wtxn is not None else self._rtxn
        dbs = self._store.dbs
        return {
            "workloads": int(txn.stat(dbs["wl"])["entries"]),
            "services": int(txn.stat(dbs["svc"])["entries"]),
            "policies": int(txn.stat(dbs["pol"])["entries"]),
            "strings": int(txn.stat(dbs["str"])["entries"]),
        }

    # --- xDS versions held (for a reconnect's initial_resource_versions) -------------------------

    def put_version(self, type_url: str, name: str, version: str) -> None:
        """Inside the batch that applied it: the version of an xDS resource now held."""
        key = name.encode()
        if len(key) > MAX_NAME_BYTES:
            return
        if self._depth:  # (the xDS client's case: once per resource of a response)
            self._cur["ver"].put(_type_prefix(type_url) + key, version.encode())
            return
        with self._batch:
            self._cur["ver"].put(_type_prefix(type_url) + key, version.encode())

    def drop_version(self, type_url: str, name: str) -> None:
        if len(name.encode()) > MAX_NAME_BYTES:
            return
        with self._batch:
            c = self._cur["ver"]
            if c.set_key(_type_prefix(type_url) + name.encode()):
                c.delete()

    def versions(self, type_url: str) -> Iterator[tuple[str, str]]:
        """The (name, version) of every resource of ``type_url`` held."""
        prefix = _type_prefix(type_url)
        n = len(prefix)
        for k, v in list(prefix_scan(self._cur["ver"], prefix)):
            yield bytes(k[n:]).decode(), bytes(v).decode()


@functools.lru_cache(maxsize=16)
def _type_prefix(type_url: str) -> bytes:
    return _lp(type_url)


def _list_add(cursor: Any, key: bytes, item: bytes) -> None:
    """Append an 8-byte item to the list held at ``key`` (a new key: one write)."""
    if not cursor.put(key, item, overwrite=False):  # (it exists: the cursor is on it)
        cursor.put(key, cursor.value() + item)


def _list_remove(cursor: Any, key: bytes, item: bytes) -> None:
    """Remove an 8-byte item from the list held at ``key`` (the key goes with the last one)."""
    raw = cursor.get(key)
    if raw is None:
        return
    kept = b"".join(raw[i : i + 8] for i in range(0, len(raw), 8) if raw[i : i + 8] != item)
    if kept:
        cursor.put(key, kept)
    else:
        cursor.delete()


def _everything(cursor: Any) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a cursor's database, in key order (a list: the cursor may be used
    again while the caller goes through it)."""
    if not cursor.first():
        return []
    return list(cursor.iternext())
