"""The node's one copy of the mesh state: an LMDB environment with one writer and many readers.

The supervisor's xDS client is the only writer; every data-plane worker opens the same files
read-only and reads the same pages (the page cache, shared: PSS counts them once however many
workers map them). LMDB gives MVCC: a reader's transaction is a consistent snapshot, so a reader
never sees a half-applied update, and a writer never waits for readers.

This module is only the mechanics: the environment's lifecycle, its named databases, the string
table (every string that repeats is stored once, with a reference count) and the key layouts.
What the databases mean, and every lookup, is :class:`ztunnel.state.store.State`'s.

Databases (``>I`` and ``>Q`` are big-endian so that keys sort by number):

    str      id >I -> utf-8            strid   utf-8 -> id >I, references >I
    wl       wid >Q -> seq >Q + record          wluid  uid -> wid >Q
    addr     net >I, len, ip -> [wid >Q]        info   ns >I, name -> [wid >Q]
    ident    ns >I, sa >I, node >I, seq -> wid  wlhost hostname >I -> [wid >Q]
    ep       svc >I, seq -> wid >Q + endpoint summary     epver  svc >I -> >Q
    svc      svc >I -> seq + record
    vip      net >I, len, ip -> [ns >I, svc >I]   host  hostname >I -> [ns >I, svc >I]
    cidr     seq >Q -> svc >I + net >I + cidr
    pol      key -> seq + pickled Authorization             polns   ns, 0, seq -> key
    ver      type url, 0, name -> version  (the xDS versions held, for reconnects)

``[...]`` is a list of fixed-size items in one value (keys with few entries: one read per
lookup); ``ep`` and ``ident``, whose keys may have thousands, have one key per entry.
``svc`` is the interned id of the service key (``ns/hostname``): workloads name the services
they are endpoints of by key, before or after the service itself arrives; ``hostname``, ``ns``,
``net``, ``sa`` and ``node`` are string ids too. ``seq`` is bumped at every upsert, so every
index lists its entries in last-upsert order (the order of the dicts an in-memory State keeps).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import lmdb

__all__ = [
    "DB_NAMES",
    "SharedStore",
    "StoreError",
    "StoreFull",
    "pack_q",
]

_Q = struct.Struct(">Q")
_I = struct.Struct(">I")
_II = struct.Struct(">II")

pack_q = _Q.pack
unpack_q = _Q.unpack_from
pack_i = _I.pack
unpack_i = _I.unpack_from

DB_NAMES = (
    "str",
    "strid",
    "wl",
    "wluid",
    "addr",
    "info",
    "ident",
    "wlhost",
    "ep",
    "epver",
    "eppick",
    "svc",
    "vip",
    "host",
    "cidr",
    "pol",
    "polns",
    "ver",
)

DEFAULT_MAP_SIZE = 2 << 30  # 2 GiB of address space; the file grows only as pages are used
PRIVATE_MAP_SIZE = 256 << 20  # a private store (tests, `ztunnel explain`)
PREFIX = "ztunnel-state-"  # the stores' directories, under the temp dir
OWNER = "owner.lock"  # flock()ed by the writer for its life
MAX_READERS = 512


class StoreError(Exception):
    """The shared state store failed (the state stays as it was before the failed change)."""


class StoreFull(StoreError):
    """The state does not fit in the store's map size (``ZTUNNEL_STATE_MAX_BYTES``)."""


class SharedStore:
    """One LMDB environment. ``create`` makes a new, empty one (the writer); ``open`` maps an
    existing one read-only (a worker). The writer removes the directory when it closes."""

    def __init__(self, env: lmdb.Environment, path: str, *, writer: bool, owned: bool) -> None:
        self.env = env
        self.path = path
        self.writer = writer
        self._owned = owned  # remove the directory on close
        self.dbs: dict[str, Any] = {}
        self.closed = False
        self._owner: int | None = None  # the writer's lock on the directory

    @classmethod
    def create(cls, parent: str | None = None, *, map_size: int = DEFAULT_MAP_SIZE) -> SharedStore:
        """A new empty store in a fresh directory under ``parent`` (default: the temp dir).
        Stores left there by writers that are gone (a ztunnel killed, its container restarted:
        the chart's /tmp is an emptyDir, which outlives the container) are removed first."""
        parent = parent or tempfile.gettempdir()
        remove_stale(parent)
        # Made under a hidden name and renamed once locked: another ztunnel cleaning up never
        # sees it unowned.
        tmp = tempfile.mkdtemp(prefix="." + PREFIX, dir=parent)
        path = os.path.join(parent, os.path.basename(tmp)[1:])
        try:
            # Held while the writer lives (an flock goes with the process, however it ends).
            owner = os.open(os.path.join(tmp, OWNER), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(owner, fcntl.LOCK_EX)
            os.rename(tmp, path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreError(f"cannot create the state store in {parent}: {e}") from None
        try:
            env = lmdb.open(
                path,
                map_size=map_size,
                max_dbs=len(DB_NAMES) + 1,
                max_readers=MAX_READERS,
                # Rebuilt at every start: nothing is ever flushed for durability.
                sync=False,
                metasync=False,
                readahead=False,
                meminit=False,
                # Written in place, in the map: a transaction's dirty pages are the file's own
                # (shared) pages, not a private copy the size of what it changed. The data file
                # is sparse, as large as the map, allocated as pages are used.
                writemap=True,
            )
        except lmdb.Error as e:
            os.close(owner)
            shutil.rmtree(path, ignore_errors=True)
            raise StoreError(f"cannot create the state store in {path}: {e}") from None
        store = cls(env, path, writer=True, owned=True)
        store._owner = owner
        with env.begin(write=True) as txn:
            for name in DB_NAMES:
                store.dbs[name] = env.open_db(name.encode(), txn=txn)
            # String id 0 is the empty string, forever (never counted, never removed).
            txn.put(pack_i(0), b"", db=store.dbs["str"])
        return store

    @classmethod
    def open(cls, path: str, *, map_size: int = DEFAULT_MAP_SIZE) -> SharedStore:
        """Map the store at ``path`` (made by :meth:`create` in another process) read-only.
        ``map_size`` must be the writer's: a reader maps only as much as it is told (LMDB sizes
        a reader's map by the space used when it opens, not by the writer's limit), and a
        snapshot past that end would not be readable."""
        try:
            env = lmdb.open(
                path,
                map_size=map_size,
                readonly=True,
                create=False,
                max_dbs=len(DB_NAMES) + 1,
                max_readers=MAX_READERS,
                readahead=False,
            )
            store = cls(env, path, writer=False, owned=False)
            for name in DB_NAMES:  # (each in a transaction of its own, committed: kept)
                store.dbs[name] = env.open_db(name.encode(), create=False)
        except lmdb.Error as e:
            raise StoreError(f"cannot open the state store at {path}: {e}") from None
        return store

    def reader(self) -> SharedStore:
        """A read-only view of this store in this process (LMDB maps an environment once per
        process: a worker in another process uses :meth:`open`)."""
        view = SharedStore(self.env, self.path, writer=False, owned=False)
        view.dbs = self.dbs
        view.closed = True  # (closing it must not close the writer's environment)
        return view

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(lmdb.Error):
            self.env.close()
        if self._owned:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None

    def reader_check(self) -> int:
        """Release the reader slots of processes that died (a killed worker's snapshot would
        otherwise keep every page it could see from being reused)."""
        try:
            return int(self.env.reader_check())
        except lmdb.Error:
            return 0

    def file_bytes(self) -> int:
        """Bytes the data file takes (its pages in use and free; it is sparse)."""
        try:
            return os.stat(os.path.join(self.path, "data.mdb")).st_blocks * 512
        except OSError:
            return 0

    def used_bytes(self) -> int:
        """Bytes of the map in use (LMDB's last used page)."""
        info = self.env.info()
        stat = self.env.stat()
        return int((info["last_pgno"] + 1) * stat["psize"])

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])


def remove_stale(parent: str) -> list[str]:
    """Remove the stores under ``parent`` whose writer is gone (nobody holds their lock)."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(path, OWNER), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None  # (made by an older build, or half made: nobody owns it)
        except OSError:
            continue
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # alive
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def prefix_scan(cursor: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) whose key starts with ``prefix``, in key order."""
    if not cursor.set_range(prefix):
        return
    n = len(prefix)
    for key, value in cursor:
        if key[:n] != prefix:
            return
        yield key, value


def prefix_values(cursor: Any, prefix: bytes) -> list[bytes]:
    """The values of the keys starting with ``prefix``, in key order: the per-connection form
    of :func:`prefix_scan` (no generator; a miss costs one seek)."""
    if not cursor.set_range(prefix):
        return []
    n = len(prefix)
    if cursor.key()[:n] != prefix:
        return []
    out = [cursor.value()]
    while cursor.next() and cursor.key()[:n] == prefix:
        out.append(cursor.value())
    return out


def prefix_keys(cursor: Any, prefix: bytes) -> list[bytes]:
    """The keys starting with ``prefix`` (a list: safe to delete them afterwards)."""
    return [k for k, _ in prefix_scan(cursor, prefix)]


def ip_key(net: int, packed: bytes) -> bytes:
    """An address in index keys: the network's string id, the IP's length, the IP."""
    return _I.pack(net) + bytes((len(packed),)) + packed


def pack_ii(a: int, b: int) -> bytes:
    return _II.pack(a, b)


def unpack_ii(raw: bytes, offset: int = 0) -> tuple[int, int]:
    a, b = _II.unpack_from(raw, offset)
    return a, b
