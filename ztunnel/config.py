"""The one frozen Config, built from the environment variables the Rust ztunnel reads.

Only this module reads the environment. Every bad value fails at start with the variable's name and
the reason (``ConfigError``). Names and defaults follow ``istio/ztunnel:src/config.rs``; the few
Python-only knobs are prefixed ``ZTUNNEL_`` and documented in the README.
"""

from __future__ import annotations

import enum
import math
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

from ztunnel.core.addr import SocketAddr

# Ports (istio/ztunnel:src/config.rs). Fixed on the wire: peers dial <pod IP>:15008.
OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
HBONE_PORT = 15008
DNS_PORT = 15053
DNS_PROXY_ADDR = f"localhost:{DNS_PORT}"
ADMIN_PORT = 15000
STATS_PORT = 15020
READINESS_PORT = 15021
# UNSTABLE_ENABLE_SOCKS5: 127.0.0.1 only, as Rust (config.rs: "TODO: use Address::Localhost").
SOCKS5_PORT = 15080
SOCKS5_HOST = "127.0.0.1"

# Connections to these ports are ztunnel calling itself (a loop): refused. Rust's illegal_ports:
# 15008, 15006, 15001, and 15080 when SOCKS5 is on (``Config.illegal_ports``).
ILLEGAL_PORTS = frozenset({OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT})
_ILLEGAL_PORTS_SOCKS5 = ILLEGAL_PORTS | {SOCKS5_PORT}

DEFAULT_INPOD_MARK = 1337
DEFAULT_INPOD_UDS = "/var/run/ztunnel/ztunnel.sock"
DEFAULT_XDS_IN_CLUSTER = "https://istiod.istio-system.svc:15012"
DEFAULT_XDS_LOCAL = "https://localhost:15012"
DEFAULT_ROOT_CA = "./var/run/secrets/istio/root-cert.pem"
DEFAULT_AUTH_TOKEN = "./var/run/secrets/tokens/istio-token"
# The mesh config the chart mounts (Rust parse_proxy_config reads this relative path).
DEFAULT_MESH_CONFIG = "./etc/istio/config/mesh"
ISTIO_META_PREFIX = "ISTIO_META_"

MiB = 1 << 20


class ConfigError(ValueError):
    """A bad environment value: names the variable and says why. ``message`` replaces the
    default ``"<var>: <reason>"`` text where Rust's own wording names the key."""

    def __init__(self, var: str, reason: str, *, message: str | None = None) -> None:
        super().__init__(message or f"{var}: {reason}")
        self.var = var
        self.reason = reason


class ProxyMode(enum.Enum):
    SHARED = "shared"  # in-pod: one ztunnel per node, listeners inside each pod's netns
    DEDICATED = "dedicated"  # one workload, listeners in the process's own netns


class CopyMode(enum.Enum):
    SPLICE = "splice"  # os.splice through pooled pipes where both legs are plain TCP
    BUFFERED = "buffered"  # userspace copy everywhere (for comparison and odd kernels)


@dataclass(frozen=True, slots=True)
class WorkloadInfo:
    """``PROXY_WORKLOAD_INFO=<namespace>/<name>/<service account>``."""

    namespace: str
    name: str
    service_account: str

    @classmethod
    def parse(cls, text: str) -> WorkloadInfo:
        # Rust construct_config: splitn(3, "/") into exactly 3 parts; empty parts are allowed
        # and the service account keeps any further "/".
        parts = text.split("/", 2)
        if len(parts) != 3:
            raise ValueError(
                f"must match the format 'namespace/name/service-account' (got {text!r})"
            )
        return cls(parts[0], parts[1], parts[2])


@dataclass(frozen=True, slots=True)
class AuthToken:
    """The bearer token for istiod (Rust ``identity::AuthSource``): a token file, read again for
    every new connection (``Token``), or the value of ``AUTH_TOKEN`` itself (``StaticToken``)."""

    path: Path | None = None
    value: str | None = None

    def __str__(self) -> str:  # (never the token itself: this reaches logs and config_dump)
        return str(self.path) if self.path is not None else "<static token>"


@dataclass(frozen=True, slots=True)
class Config:
    proxy_mode: ProxyMode = ProxyMode.SHARED
    # ENABLE_PROXY (Rust ``proxy``): false runs the DNS proxy alone, no 15001/15006/15008.
    enable_proxy: bool = True
    proxy_workload_info: WorkloadInfo | None = None

    # Identity and placement
    node_name: str = ""
    pod_name: str = ""
    pod_namespace: str = ""
    service_account: str = ""
    # ztunnel's own workload, when POD_NAMESPACE, POD_NAME and SERVICE_ACCOUNT are all set (the
    # chart sets them from the Downward API): in shared mode, the self-proxy's inbound HBONE
    # listener serves it (Rust config.rs ztunnel_workload, proxyfactory.rs
    # create_ztunnel_self_proxy_listener).
    ztunnel_workload: WorkloadInfo | None = None
    instance_ip: str = ""
    trust_domain: str = "cluster.local"
    cluster_id: str = "Kubernetes"
    cluster_domain: str = "cluster.local"
    network: str = ""

    # Config sources
    local_xds_path: Path | None = None
    local_xds: str | None = None
    xds_address: str | None = None  # None: no xDS
    xds_root_ca: str = DEFAULT_ROOT_CA
    alt_xds_hostname: str | None = None
    auth_token: AuthToken | None = None  # None: no token (Rust AuthSource::None)
    xds_headers: tuple[tuple[str, str], ...] = ()
    xds_on_demand: bool = False

    # Certificates
    ca_address: str | None = None  # None: the local CA
    ca_root_ca: str = DEFAULT_ROOT_CA
    alt_ca_hostname: str | None = None
    ca_headers: tuple[tuple[str, str], ...] = ()
    fake_ca: bool = False
    secret_ttl: timedelta = timedelta(hours=24)
    local_ca_dir: Path | None = None  # ZTUNNEL_LOCAL_CA_DIR: share one local root between processes

    # Data plane. PACKET_MARK defaults to 1337 in shared mode only (Rust config.rs); None: no
    # SO_MARK (so dedicated mode needs no CAP_NET_ADMIN/CAP_NET_RAW). 0 also means none here.
    packet_mark: int | None = DEFAULT_INPOD_MARK
    ipv6_enabled: bool = True
    enable_orig_src: bool | None = None  # None: best effort
    inpod_uds: Path = Path(DEFAULT_INPOD_UDS)
    inpod_port_reuse: bool = True
    localhost_app_tunnel: bool = True
    enable_response_baggage: bool = True
    pool_max_streams_per_connection: int = 100
    pool_unused_release_timeout: timedelta = timedelta(minutes=5)
    http2_stream_window_size: int = 4 * MiB
    http2_connection_window_size: int = 16 * MiB
    http2_frame_size: int = 1 * MiB
    keepalive_enabled: bool = True
    keepalive_time: timedelta = timedelta(seconds=180)
    keepalive_interval: timedelta = timedelta(seconds=180)
    keepalive_retries: int = 9
    user_timeout_enabled: bool = False
    # UNSTABLE_ENABLE_SOCKS5: a SOCKS5 listener on 127.0.0.1:15080 beside each proxy instance's
    # other listeners (Rust socks5_addr), off by default.
    socks5: bool = False
    connection_termination_deadline: timedelta = timedelta(seconds=5)
    copy_mode: CopyMode = CopyMode.SPLICE  # ZTUNNEL_COPY_MODE
    malloc_tuning: bool = True  # ZTUNNEL_MALLOC_TUNING: see ztunnel/net/malloc.py
    # ZTUNNEL_MALLOC_TRIM_INTERVAL: how often free heap memory is returned to the kernel (0: never)
    malloc_trim_interval: timedelta = timedelta(seconds=5)

    # From the chart (src/config.rs, src/lib.rs): PREFERED_SERVICE_NAMESPACE (hostname
    # lookups' preference after the client's namespace and canonical services), TLS12_ENABLED
    # (TLS 1.2 next to 1.3 on HBONE), CRL_PATH (peers checked against it), and from the mesh
    # config / PROXY_CONFIG: proxyMetadata (sent in the xDS node metadata) and concurrency
    # (one input of the worker count, below).
    prefered_service_namespace: str | None = None
    tls12_enabled: bool = False
    crl_path: Path | None = None
    proxy_metadata: tuple[tuple[str, str], ...] = ()
    concurrency: int | None = None
    # Data-plane workers (Rust num_worker_threads, see worker_threads()): 1 runs everything in
    # one process; N >= 2 runs N worker processes beside a control-plane supervisor.
    num_worker_threads: int = 1
    # Python-only: a worker grown by this many bytes of private memory over its fresh size,
    # and idle, is replaced by a fresh one (workers/recycle.py; ZTUNNEL_WORKER_RECYCLE_MIB, 0
    # never), checked every ZTUNNEL_WORKER_RECYCLE_INTERVAL.
    worker_recycle_growth: int = 8 * MiB
    worker_recycle_interval: timedelta = timedelta(seconds=30)

    # Observability (the *_port knobs are Python-only, ZTUNNEL_{ADMIN,STATS,READINESS}_PORT: two
    # ztunnels sharing one network namespace, as in tests, need different ones; 0 disables)
    admin_port: int = ADMIN_PORT
    stats_port: int = STATS_PORT
    readiness_port: int = READINESS_PORT
    log_format: str = "plain"
    rust_log: str = "info"
    # AUTHZ_POLICY_INFO_LOGGING=true (exactly, as Rust reads it): the authorization decision
    # logs at info instead of debug.
    authz_policy_info_logging: bool = False
    # ZTUNNEL_METRICS_FLUSH_INTERVAL (Python-only): how often live connections' byte counts are
    # added to the metrics (Rust counts every read/write; we batch them).
    metrics_flush_interval: timedelta = timedelta(seconds=5)

    # Hostile-peer limits (Python-only; README "Security"). HTTP/2 budgets are per connection and
    # per second; past one the connection ends with GOAWAY ENHANCE_YOUR_CALM.
    h2_max_control_frames: int = 1000  # ZTUNNEL_H2_MAX_CONTROL_FRAMES
    h2_max_window_updates: int = 10_000  # ZTUNNEL_H2_MAX_WINDOW_UPDATES
    h2_max_empty_frames: int = 100  # ZTUNNEL_H2_MAX_EMPTY_FRAMES
    h2_max_early_resets: int = 200  # ZTUNNEL_H2_MAX_EARLY_RESETS (rapid reset)
    h2_max_continuations: int = 32  # ZTUNNEL_H2_MAX_CONTINUATIONS (per header block)
    # ZTUNNEL_H2_BUFFER_BUDGET: HBONE bytes held in memory, node-wide (each worker: 1/N of it)
    h2_buffer_budget: int = 32 * MiB
    fd_reserve: int | None = None  # ZTUNNEL_FD_RESERVE: fds kept free (None: 10%, 32..1024)
    # ZTUNNEL_STATE_MAX_BYTES (Python-only): the most the shared state store (ztunnel/state/
    # shared.py, a file in $TMPDIR) may hold; xDS that would not fit is NACKed, nothing applied.
    state_max_bytes: int = 2 << 30
    # ZTUNNEL_COPY_BUDGET: bytes the node's data plane may hold in splice pipes and large copy
    # buffers at once, split evenly over the workers (net/copy.PipePool, DEFAULT_BUDGET there).
    copy_budget: int = 32 << 20

    # DNS proxy (istio/ztunnel src/config.rs): ISTIO_META_DNS_CAPTURE (on unless set to anything
    # but "true", any case), ISTIO_META_DNS_PROXY_ADDR ("localhost:<port>" = 127.0.0.1 and, where
    # IPv6 works on lo, [::1]; or one "ip:port").
    dns_proxy: bool = True
    dns_proxy_addr: str = DNS_PROXY_ADDR
    dns_resolv_conf: Path = Path("/etc/resolv.conf")  # ZTUNNEL_DNS_RESOLV_CONF (Python-only)

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, mesh_config: str = DEFAULT_MESH_CONFIG) -> Config:
        """Build and validate. Raises ConfigError naming the first bad variable.

        ``mesh_config`` is the mesh config file whose ``defaultConfig`` is merged under
        ``PROXY_CONFIG`` (Rust ``construct_proxy_config``); a missing file is no error."""
        return _build(_Env(env), _proxy_config(env, mesh_config))

    def summary(self) -> dict[str, Any]:
        """The effective config as plain JSON-able values (logged once, shown in config_dump)."""
        out: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if k == "local_xds" and v is not None:
                v = f"<{len(v)} bytes inline>"
            elif k == "auth_token":
                v = None if self.auth_token is None else str(self.auth_token)
            out[k] = _jsonable(v)
        return out

    @property
    def illegal_ports(self) -> frozenset[int]:
        """Ports no connection may target on ztunnel's own addresses (Rust ``illegal_ports``)."""
        return _ILLEGAL_PORTS_SOCKS5 if self.socks5 else ILLEGAL_PORTS

    @property
    def local_config_given(self) -> bool:
        return self.local_xds_path is not None or self.local_xds is not None


def _jsonable(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, timedelta):
        return format_duration(v)
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


# --- value parsers: Rust's FromStr rules (src/config.rs parse, parse_default, parse_duration) ----
#
# Rust reads a variable with ``env::var`` and, when it is set (even to ""), parses it with the
# type's ``FromStr``: a bad value, the empty string included, is an error naming the variable.
# These functions are those ``FromStr`` rules; each raises ValueError with Rust's message.


def rust_bool(text: str) -> bool:
    """``bool::from_str``: exactly ``true`` or ``false``."""
    if text == "true":
        return True
    if text == "false":
        return False
    raise ValueError("provided string was not `true` or `false`")


def rust_uint(text: str, bits: int) -> int:
    """``u16``/``u32``/``u64::from_str``: decimal ASCII digits, an optional leading ``+``,
    nothing else (no spaces, ``_``, ``0x`` or sign ``-``)."""
    if not text:
        raise ValueError("cannot parse integer from empty string")
    digits = text[1:] if text[0] == "+" else text
    if not digits or not all("0" <= c <= "9" for c in digits):
        raise ValueError("invalid digit found in string")
    n = int(digits)
    if n >= 1 << bits:
        raise ValueError("number too large to fit in target type")
    return n


_RUST_FLOAT = re.compile(
    r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE | re.ASCII
)


def rust_f64(text: str) -> float:
    """``f64::from_str``: ``1``, ``1.5``, ``.5``, ``5.``, ``1e3``, ``inf``, ``NaN``; no spaces or
    ``_`` (which Python's ``float`` accepts)."""
    if not text:
        raise ValueError("cannot parse float from empty string")
    if not _RUST_FLOAT.fullmatch(text):
        raise ValueError("invalid float literal")
    return float(text)


_NS = {
    "y": 365 * 86400 * 10**9,
    "mon": 30 * 86400 * 10**9,
    "w": 7 * 86400 * 10**9,
    "d": 86400 * 10**9,
    "h": 3600 * 10**9,
    "m": 60 * 10**9,
    "s": 10**9,
    "ms": 10**6,
    "us": 10**3,
    "ns": 1,
}
_UNIT_NAMES = {
    **{n: "y" for n in ("y", "year", "years")},
    **{n: "mon" for n in ("mon", "month", "months")},
    **{n: "w" for n in ("w", "week", "weeks")},
    **{n: "d" for n in ("d", "day", "days")},
    **{n: "h" for n in ("h", "hr", "hour", "hours")},
    **{n: "m" for n in ("m", "min", "minute", "minutes")},
    **{n: "s" for n in ("s", "sec", "second", "seconds")},
    **{n: "ms" for n in ("ms", "msec", "millisecond", "milliseconds")},
    **{
        n: "us"
        for n in ("µs", "µsec", "µsecond", "us", "usec", "usecond", "microsecond", "microseconds")
    },
    **{n: "ns" for n in ("ns", "nsec", "nanosecond", "nanoseconds")},
}
_U64 = (1 << 64) - 1
_DURATION_TERM = re.compile(r"[ \t\r\n]*([0-9]+)[ \t\r\n]*([A-Za-zµ]*)[ \t\r\n]*")


def parse_duration(text: str) -> timedelta:
    """Rust ``duration_str::parse`` (0.21, what ``parse_duration`` uses): whole numbers with a
    unit (``y mon w d h m s ms us ns`` and their long names, any case; none means seconds),
    joined by nothing (``1m30s``), by ``+``, or by ``*`` (a product, in seconds), never both;
    spaces anywhere between terms. No fractions, no signs; at most 2^64-1 ns."""
    if not text:
        raise ValueError("Empty input")
    pos, terms = 0, list[tuple[str, int]]()  # (joiner, ns); the first term's joiner is ""
    while pos < len(text):
        joiner = ""
        if terms:
            rest = text[pos:].lstrip(" \t\r\n")
            if not rest:
                break
            pos = len(text) - len(rest)
            if rest[0] in "+*":
                joiner = rest[0]
                pos += 1
            elif not rest[0].isascii() or not rest[0].isdigit():
                raise ValueError(f"invalid duration {text!r}: expected one of [+, *] at {rest!r}")
            else:
                joiner = "+"
        m = _DURATION_TERM.match(text, pos)
        if m is None:
            raise ValueError(f"invalid duration {text!r}: expected a number at {text[pos:]!r}")
        value, unit = int(m.group(1)), m.group(2)
        if unit:
            name = _UNIT_NAMES.get(unit.lower())
            if name is None:
                raise ValueError(
                    f"invalid duration {text!r}: expect one of [y, mon, w, d, h, m, s, ms, µs, "
                    f"us, ns], but find: {unit.lower()}"
                )
        else:
            name = "s"
            nxt = m.end()
            if nxt < len(text) and text[nxt] not in "+*":
                raise ValueError(f"invalid duration {text!r}: expected a unit at {text[nxt:]!r}")
        if value > _U64:
            raise ValueError("number too large to fit in target type")
        ns = value * _NS[name]
        if ns > _U64:
            raise ValueError("overflow error")
        terms.append((joiner, ns))
        pos = m.end()
    first, tail = terms[0][1], terms[1:]
    if not tail:
        total = first
    elif any(j != tail[0][0] for j, _ in tail):
        raise ValueError("not support '+' with '*' calculate")
    elif tail[0][0] == "+":
        total = first + sum(ns for _, ns in tail)
    else:  # a product in seconds (1m*10 is 600s, 1m*10ms is 0.6s), whole ns at each step
        acc = 10**9
        for _, ns in tail:
            acc = math.floor(Fraction(acc * ns, 10**9))
            if acc > _U64:
                raise ValueError("overflow error")
        total = math.floor(Fraction(first * acc, 10**9))
    if total > _U64:
        raise ValueError("overflow error")
    return timedelta(microseconds=total // 1000)


def format_duration(d: timedelta) -> str:
    s = d.total_seconds()
    if s and s < 1:
        return f"{round(s * 1000)}ms"
    return f"{s:g}s"


class _Env:
    """Typed accessors over the environment, with Rust's parsing rules; each raises ConfigError
    with the variable name."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def get(self, name: str, default: str = "") -> str:
        return self.env.get(name, default)

    def opt(self, name: str) -> str | None:
        return self.env.get(name)

    def _parse(self, name: str, parse: Callable[[str], Any]) -> Any:
        raw = self.env.get(name)
        if raw is None:
            return None
        try:
            return parse(raw)
        except ValueError as e:
            raise ConfigError(name, f"invalid value {raw!r} ({e})") from None

    def flag(self, name: str, default: bool) -> bool:
        """``parse_default::<bool>``."""
        v = self.opt_flag(name)
        return default if v is None else v

    def opt_flag(self, name: str) -> bool | None:
        """``parse::<bool>``: None when unset."""
        v: bool | None = self._parse(name, rust_bool)
        return v

    def uint(self, name: str, default: int, bits: int) -> int:
        """``parse_default::<u16/u32/u64>``."""
        v: int | None = self._parse(name, lambda t: rust_uint(t, bits))
        return default if v is None else v

    def integer(self, name: str, default: int, lo: int, hi: int) -> int:
        """A ``u32``-sized decimal with a range check of ours (Python-only knobs, and the HTTP/2
        sizes: see the README's Configuration)."""
        v = self.uint(name, default, 32 if hi < 1 << 32 else 64)
        if not lo <= v <= hi:
            raise ConfigError(name, f"{v} out of range {lo}..{hi}")
        return v

    def opt_duration(self, name: str) -> timedelta | None:
        """``parse_duration``: None when unset."""
        v: timedelta | None = self._parse(name, parse_duration)
        return v

    def duration(self, name: str, default: timedelta) -> timedelta:
        v = self.opt_duration(name)
        return default if v is None else v

    def prefixed(self, prefix: str) -> tuple[tuple[str, str], ...]:
        return tuple(
            sorted(
                (k[len(prefix) :].lower(), v) for k, v in self.env.items() if k.startswith(prefix)
            )
        )


def _termination_deadline(e: _Env) -> timedelta:
    deadline = e.opt_duration("CONNECTION_TERMINATION_DEADLINE")
    if deadline is not None:
        return deadline
    if e.opt("TERMINATION_GRACE_PERIOD_SECONDS") is not None:
        s = e.uint("TERMINATION_GRACE_PERIOD_SECONDS", 0, 64)
        # Leave the kubelet time to SIGKILL after us: s-5 for long grace periods, else s-1, min
        # 1 s. (For 0, Rust's u64 ``0 - 1`` wraps to an endless drain; ours is the 1 s minimum.)
        # Capped at what a timedelta holds (about 2.7 million years).
        return timedelta(seconds=min(max(1, s - 5 if s > 10 else s - 1), _MAX_SECONDS))
    return timedelta(seconds=5)


_MAX_SECONDS = timedelta.max.days * 86400


@dataclass(frozen=True, slots=True)
class _ProxyConfig:
    """The ProxyConfig fields ztunnel reads (Rust ``ProxyConfig``), merged from the mesh config's
    ``defaultConfig`` then ``PROXY_CONFIG`` (later wins, metadata maps merge)."""

    discovery_address: str | None = None
    proxy_admin_port: int | None = None
    stats_port: int | None = None
    concurrency: int | None = None
    proxy_metadata: tuple[tuple[str, str], ...] = ()


def _parse_proxy_config(doc: Any, var: str) -> _ProxyConfig:
    if doc is None:
        return _ProxyConfig()
    if not isinstance(doc, dict):
        raise ConfigError(var, f"want a mapping of ProxyConfig fields, got {type(doc).__name__}")

    def port(key: str) -> int | None:
        v = doc.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
            raise ConfigError(var, f"{key}: want a port (0-65535), got {v!r}")
        return v

    addr = doc.get("discoveryAddress")
    if addr is not None and not isinstance(addr, str):
        raise ConfigError(var, f"discoveryAddress: want a string, got {addr!r}")
    meta = doc.get("proxyMetadata") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise ConfigError(var, "proxyMetadata: want a mapping of strings to strings")
    return _ProxyConfig(
        discovery_address=addr,
        proxy_admin_port=port("proxyAdminPort"),
        stats_port=port("statsPort"),
        concurrency=port("concurrency"),  # a u16 in Rust
        proxy_metadata=tuple(meta.items()),
    )


def _proxy_config(env: Mapping[str, str], mesh_path: str) -> _ProxyConfig:
    """Rust ``construct_proxy_config``: mesh config ``defaultConfig``, then ``PROXY_CONFIG``; the
    metadata keys lose an ``ISTIO_META_`` prefix."""
    layers: list[_ProxyConfig] = []
    try:
        with open(mesh_path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = None
    except OSError as e:
        raise ConfigError("mesh config", f"cannot read {mesh_path}: {e}") from None
    raw = env.get("PROXY_CONFIG")
    if text is None and not raw:
        return _ProxyConfig()  # nothing to parse: no PyYAML in memory (issue 18)
    import yaml  # local: only start-up needs it

    if text is not None:
        try:
            mesh = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError("mesh config", f"failed parsing {mesh_path}: {e}") from None
        if mesh is not None and not isinstance(mesh, dict):
            raise ConfigError("mesh config", f"{mesh_path}: want a mapping")
        layers.append(_parse_proxy_config((mesh or {}).get("defaultConfig"), "mesh config"))
    if raw:
        try:
            doc = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError("PROXY_CONFIG", f"failed parsing proxy config: {e}") from None
        layers.append(_parse_proxy_config(doc, "PROXY_CONFIG"))
    out = _ProxyConfig()
    meta: dict[str, str] = {}
    for pc in layers:
        out = _ProxyConfig(
            discovery_address=pc.discovery_address or out.discovery_address,
            proxy_admin_port=(
                pc.proxy_admin_port if pc.proxy_admin_port is not None else out.proxy_admin_port
            ),
            stats_port=pc.stats_port if pc.stats_port is not None else out.stats_port,
            concurrency=pc.concurrency if pc.concurrency is not None else out.concurrency,
        )
        meta.update(pc.proxy_metadata)
    stripped = {
        (k[len(ISTIO_META_PREFIX) :] if k.startswith(ISTIO_META_PREFIX) else k): v
        for k, v in meta.items()
    }
    return _ProxyConfig(
        out.discovery_address,
        out.proxy_admin_port,
        out.stats_port,
        out.concurrency,
        tuple(sorted(stripped.items())),
    )


def _compliance_policy(e: _Env) -> None:
    """Rust src/lib.rs: ``COMPLIANCE_POLICY=pqc`` restricts key exchange to X25519MLKEM768
    (and panics without OpenSSL >= 3.5); any other value is ignored. Python's ``ssl`` cannot
    select TLS 1.3 key-exchange groups, so pqc is refused here rather than silently not
    applied."""
    if e.get("COMPLIANCE_POLICY") == "pqc":
        raise ConfigError(
            "COMPLIANCE_POLICY",
            "pqc needs the X25519MLKEM768 key exchange only; Python's ssl module cannot "
            f"restrict TLS key-exchange groups ({ssl.OPENSSL_VERSION}), so it cannot be honoured",
        )


def _build(e: _Env, pc: _ProxyConfig | None = None) -> Config:
    pc = pc or _ProxyConfig()
    _compliance_policy(e)
    raw_mode = e.opt("PROXY_MODE")
    try:  # exactly "shared" or "dedicated"
        mode = ProxyMode.SHARED if raw_mode is None else ProxyMode(raw_mode)
    except ValueError:
        raise ConfigError(
            "PROXY_MODE",
            f"invalid value {raw_mode!r} (PROXY_MODE must be one of dedicated, shared)",
        ) from None

    info: WorkloadInfo | None = None
    # Rust reads PROXY_WORKLOAD_INFO only outside shared mode (ZDS names the workloads there).
    raw_info = e.opt("PROXY_WORKLOAD_INFO") if mode is not ProxyMode.SHARED else None
    if raw_info is not None:
        try:
            info = WorkloadInfo.parse(raw_info)
        except ValueError as err:
            raise ConfigError("PROXY_WORKLOAD_INFO", str(err)) from None
    if mode is ProxyMode.DEDICATED and info is None:
        raise ConfigError("PROXY_WORKLOAD_INFO", "required when PROXY_MODE=dedicated")

    local_path = e.opt("LOCAL_XDS_PATH") or None
    local_inline = e.opt("LOCAL_XDS") or None
    if local_path and local_inline:
        raise ConfigError("LOCAL_XDS_PATH", "set either LOCAL_XDS_PATH or LOCAL_XDS, not both")
    if local_path and not Path(local_path).is_file():
        raise ConfigError("LOCAL_XDS_PATH", f"no such file {local_path!r}")

    # XDS_ADDRESS: set and empty disables xDS. Unset: local config alone if one is given, else istiod.
    raw_xds = e.opt("XDS_ADDRESS")
    xds_address: str | None
    if raw_xds is not None:
        xds_address = raw_xds.strip() or None
    elif pc.discovery_address is not None:  # mesh config / PROXY_CONFIG discoveryAddress
        xds_address = pc.discovery_address.strip() or None
    elif local_path or local_inline:
        xds_address = None
    else:
        in_cluster = e.opt("KUBERNETES_SERVICE_HOST") is not None  # set, even empty
        xds_address = DEFAULT_XDS_IN_CLUSTER if in_cluster else DEFAULT_XDS_LOCAL
    if xds_address is not None:
        xds_address = _validate_url("XDS_ADDRESS", xds_address)

    fake_ca = e.flag("FAKE_CA", False)
    raw_ca = e.opt("CA_ADDRESS")
    ca_address = None if fake_ca or raw_ca is None or not raw_ca.strip() else raw_ca.strip()
    if ca_address is not None:
        ca_address = _validate_url("CA_ADDRESS", ca_address)

    # Rust: PACKET_MARK as a u32, else 1337 in shared mode (in-pod needs it), else none.
    mark_default = DEFAULT_INPOD_MARK if mode is ProxyMode.SHARED else 0
    packet_mark: int | None = e.uint("PACKET_MARK", mark_default, 32) or None

    ipv6 = e.flag("IPV6_ENABLED", True)
    ttl = e.duration("SECRET_TTL", timedelta(hours=24))
    if ttl.total_seconds() <= 0:
        raise ConfigError("SECRET_TTL", "must be positive")

    try:
        copy_mode = CopyMode(e.get("ZTUNNEL_COPY_MODE", "splice").strip().lower())
    except ValueError:
        raise ConfigError("ZTUNNEL_COPY_MODE", "want splice or buffered") from None

    stream_window = e.integer("HTTP2_STREAM_WINDOW_SIZE", 4 * MiB, 65535, 2**31 - 1)
    conn_window = e.integer("HTTP2_CONNECTION_WINDOW_SIZE", 16 * MiB, 65535, 2**31 - 1)
    frame_size = e.integer("HTTP2_FRAME_SIZE", 1 * MiB, 16384, 2**24 - 1)

    # src/telemetry.rs: exactly "json" logs JSON; anything else is plain.
    log_format = "json" if e.get("LOG_FORMAT") == "json" else "plain"

    ca_dir = e.opt("ZTUNNEL_LOCAL_CA_DIR")

    flush = e.duration("ZTUNNEL_METRICS_FLUSH_INTERVAL", timedelta(seconds=5))
    if flush.total_seconds() <= 0:
        raise ConfigError("ZTUNNEL_METRICS_FLUSH_INTERVAL", "must be positive")
    recycle_every = e.duration("ZTUNNEL_WORKER_RECYCLE_INTERVAL", timedelta(seconds=30))
    if recycle_every.total_seconds() <= 0:
        raise ConfigError("ZTUNNEL_WORKER_RECYCLE_INTERVAL", "must be positive")

    dns_proxy, dns_proxy_addr = _dns_proxy(e, dict(pc.proxy_metadata) if pc is not None else {})
    enable_proxy = e.flag("ENABLE_PROXY", True)
    xds_on_demand = e.flag("XDS_ON_DEMAND", False)
    # config.rs validate_config, in its order
    if dns_proxy and xds_on_demand:
        raise ConfigError("XDS_ON_DEMAND", "DNS proxy does not currently support on-demand mode")
    if not enable_proxy and not dns_proxy:
        raise ConfigError(
            "ENABLE_PROXY",
            "ztunnel run without any servers enabled",
            message="error parsing proxy config: ztunnel run without any servers enabled",
        )

    return Config(
        proxy_mode=mode,
        enable_proxy=enable_proxy,
        proxy_workload_info=info,
        node_name=e.get("NODE_NAME"),
        pod_name=e.get("POD_NAME"),
        pod_namespace=e.get("POD_NAMESPACE"),
        service_account=e.get("SERVICE_ACCOUNT"),
        ztunnel_workload=_ztunnel_workload(e),
        instance_ip=e.get("INSTANCE_IP"),
        trust_domain=e.get("TRUST_DOMAIN", "cluster.local") or "cluster.local",
        # Rust: ISTIO_META_CLUSTER_ID when set (even empty), else CLUSTER_ID, else Kubernetes.
        cluster_id=_cluster_id(e),
        cluster_domain=e.get("CLUSTER_DOMAIN", "cluster.local") or "cluster.local",
        network=e.get("NETWORK"),
        local_xds_path=Path(local_path) if local_path else None,
        local_xds=local_inline,
        xds_address=xds_address,
        xds_root_ca=e.get("XDS_ROOT_CA", DEFAULT_ROOT_CA) or DEFAULT_ROOT_CA,
        alt_xds_hostname=e.opt("ALT_XDS_HOSTNAME") or None,
        auth_token=_auth_token(e),
        xds_headers=e.prefixed("XDS_HEADER_"),
        xds_on_demand=xds_on_demand,
        ca_address=ca_address,
        ca_root_ca=e.get("CA_ROOT_CA", DEFAULT_ROOT_CA) or DEFAULT_ROOT_CA,
        alt_ca_hostname=e.opt("ALT_CA_HOSTNAME") or None,
        ca_headers=e.prefixed("CA_HEADER_"),
        fake_ca=fake_ca,
        secret_ttl=ttl,
        local_ca_dir=Path(ca_dir) if ca_dir else None,
        packet_mark=packet_mark,
        ipv6_enabled=ipv6,
        enable_orig_src=e.opt_flag("ENABLE_ORIG_SRC"),
        inpod_uds=Path(e.get("INPOD_UDS", DEFAULT_INPOD_UDS) or DEFAULT_INPOD_UDS),
        inpod_port_reuse=e.flag("INPOD_PORT_REUSE", True),
        localhost_app_tunnel=e.flag("LOCALHOST_APP_TUNNEL", True),
        enable_response_baggage=e.flag("ENABLE_RESPONSE_BAGGAGE", True),
        pool_max_streams_per_connection=e.uint("POOL_MAX_STREAMS_PER_CONNECTION", 100, 16),
        pool_unused_release_timeout=e.duration("POOL_UNUSED_RELEASE_TIMEOUT", timedelta(minutes=5)),
        http2_stream_window_size=stream_window,
        http2_connection_window_size=conn_window,
        http2_frame_size=frame_size,
        keepalive_enabled=e.flag("KEEPALIVE_ENABLED", True),
        keepalive_time=e.duration("KEEPALIVE_TIME", timedelta(seconds=180)),
        keepalive_interval=e.duration("KEEPALIVE_INTERVAL", timedelta(seconds=180)),
        keepalive_retries=e.uint("KEEPALIVE_RETRIES", 9, 32),  # (the kernel takes 1..127)
        user_timeout_enabled=e.flag("USER_TIMEOUT_ENABLED", False),
        socks5=e.flag("UNSTABLE_ENABLE_SOCKS5", False),
        connection_termination_deadline=_termination_deadline(e),
        copy_mode=copy_mode,
        malloc_tuning=e.flag("ZTUNNEL_MALLOC_TUNING", True),
        malloc_trim_interval=e.duration("ZTUNNEL_MALLOC_TRIM_INTERVAL", timedelta(seconds=5)),
        prefered_service_namespace=e.opt("PREFERED_SERVICE_NAMESPACE"),
        tls12_enabled=e.get("TLS12_ENABLED") == "true",  # exactly "true", as Rust compares
        crl_path=Path(crl) if (crl := e.get("CRL_PATH")) else None,
        proxy_metadata=pc.proxy_metadata,
        concurrency=pc.concurrency,
        num_worker_threads=worker_threads(e.env, pc.concurrency),
        worker_recycle_growth=e.integer("ZTUNNEL_WORKER_RECYCLE_MIB", 8, 0, 1 << 20) * MiB,
        worker_recycle_interval=recycle_every,
        # ZTUNNEL_*_PORT (Python-only) first, then the mesh config's proxyAdminPort/statsPort.
        admin_port=e.integer(
            "ZTUNNEL_ADMIN_PORT",
            pc.proxy_admin_port if pc.proxy_admin_port is not None else ADMIN_PORT,
            0,
            65535,
        ),
        stats_port=e.integer(
            "ZTUNNEL_STATS_PORT",
            pc.stats_port if pc.stats_port is not None else STATS_PORT,
            0,
            65535,
        ),
        readiness_port=e.integer("ZTUNNEL_READINESS_PORT", READINESS_PORT, 0, 65535),
        log_format=log_format,
        rust_log=e.get("RUST_LOG", "info") or "info",
        authz_policy_info_logging=e.get("AUTHZ_POLICY_INFO_LOGGING") == "true",
        metrics_flush_interval=flush,
        h2_max_control_frames=e.integer("ZTUNNEL_H2_MAX_CONTROL_FRAMES", 1000, 1, 10**9),
        h2_max_window_updates=e.integer("ZTUNNEL_H2_MAX_WINDOW_UPDATES", 10_000, 1, 10**9),
        h2_max_empty_frames=e.integer("ZTUNNEL_H2_MAX_EMPTY_FRAMES", 100, 1, 10**9),
        h2_max_early_resets=e.integer("ZTUNNEL_H2_MAX_EARLY_RESETS", 200, 1, 10**9),
        h2_max_continuations=e.integer("ZTUNNEL_H2_MAX_CONTINUATIONS", 32, 1, 10**6),
        h2_buffer_budget=e.integer("ZTUNNEL_H2_BUFFER_BUDGET", 32 * MiB, MiB, 2**40),
        fd_reserve=(
            e.integer("ZTUNNEL_FD_RESERVE", 0, 0, 10**7)
            if e.opt("ZTUNNEL_FD_RESERVE") is not None
            else None
        ),
        copy_budget=e.integer("ZTUNNEL_COPY_BUDGET", 32 << 20, 1 << 20, 1 << 40),
        dns_proxy=dns_proxy,
        dns_proxy_addr=dns_proxy_addr,
        dns_resolv_conf=Path(e.get("ZTUNNEL_DNS_RESOLV_CONF") or "/etc/resolv.conf"),
        state_max_bytes=e.integer("ZTUNNEL_STATE_MAX_BYTES", 2 << 30, 1 << 20, 1 << 40),
    )


def _auth_token(e: _Env) -> AuthToken | None:
    """Rust construct_config ``auth``: unset, the default token file if it exists, else no token;
    set, an existing path is a token file and anything else the token itself."""
    raw = e.opt("AUTH_TOKEN")
    if raw is None:
        return (
            AuthToken(path=Path(DEFAULT_AUTH_TOKEN)) if os.path.exists(DEFAULT_AUTH_TOKEN) else None
        )
    if raw and os.path.exists(raw):
        return AuthToken(path=Path(raw))
    return AuthToken(value=raw)


def _dns_proxy(e: _Env, metadata: Mapping[str, str]) -> tuple[bool, str]:
    """config.rs: DNS_CAPTURE and DNS_PROXY_ADDR from the proxy metadata (mesh config and
    PROXY_CONFIG ``proxyMetadata``, then ``ISTIO_META_*`` variables, which win)."""
    raw = e.opt("ISTIO_META_DNS_CAPTURE")
    if raw is None:
        raw = metadata.get("DNS_CAPTURE")
    enabled = raw is None or raw.lower() == "true"
    addr = e.opt("ISTIO_META_DNS_PROXY_ADDR")
    if addr is None:
        addr = metadata.get("DNS_PROXY_ADDR")
    if addr is None:
        return enabled, DNS_PROXY_ADDR
    try:  # config.rs Address::new: "localhost:<u16>", else a SocketAddr
        if addr.startswith("localhost:"):
            addr = f"localhost:{rust_uint(addr.split(':', 1)[1], 16)}"
        elif addr != addr.strip() or not _socket_addr(addr):
            raise ValueError("invalid socket address syntax")
    except ValueError as err:
        # Rust's wording, which names the metadata key (set by ISTIO_META_DNS_PROXY_ADDR or
        # proxyMetadata): "invalid configuration: failed to parse DNS_PROXY_ADDR: ...".
        reason = f"failed to parse DNS_PROXY_ADDR: {addr} ({err})"
        raise ConfigError("DNS_PROXY_ADDR", reason, message=reason) from None
    return enabled, addr


def _socket_addr(text: str) -> bool:
    """``SocketAddr::from_str``: ``a.b.c.d:port`` or ``[v6]:port``, a decimal u16 port."""
    host, sep, port = text.rpartition(":")
    if not sep or not port or not all("0" <= c <= "9" for c in port) or int(port) > 65535:
        return False
    try:
        SocketAddr.parse(text)
    except ValueError:
        return False
    return host.startswith("[") or ":" not in host


def _ztunnel_workload(e: _Env) -> WorkloadInfo | None:
    """Rust config.rs: ztunnel's own workload from the Downward API variables, when all three
    are set (even empty, as Rust's ``parse`` takes them)."""
    ns, sa, name = e.opt("POD_NAMESPACE"), e.opt("SERVICE_ACCOUNT"), e.opt("POD_NAME")
    if ns is None or sa is None or name is None:
        return None
    return WorkloadInfo(ns, name, sa)


def _cluster_id(e: _Env) -> str:
    meta = e.opt(ISTIO_META_PREFIX + "CLUSTER_ID")
    if meta is not None:
        return meta
    return e.get("CLUSTER_ID", "Kubernetes")


def _validate_url(var: str, url: str) -> str:
    """Accept ``https://host:port`` or ``host:port`` (then https is implied), as ztunnel does."""
    if "://" not in url:
        url = "https://" + url
    m = re.fullmatch(r"(https?)://([^/:\s]+|\[[0-9a-fA-F:.]+\])(?::(\d+))?/?", url)
    if not m or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
        raise ConfigError(var, f"invalid address {url!r} (want https://host:port)")
    return url


# --- data-plane worker count (Rust src/config.rs) -------------------------------------------------

DEFAULT_WORKER_THREADS = 2
DEFAULT_WORKER_THREAD_CPU_FRACTION = 0.25


def available_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Logical CPUs this process may use, capped by the cgroup v2 quota (what Rust's
    ``num_cpus::get()`` answers)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = cpus or 1
    try:
        with open(cgroup_cpu_max) as f:
            quota, _, period = f.read().strip().partition(" ")
        if quota != "max" and period:
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def cpu_quantity(env: Mapping[str, str], name: str) -> int | None:
    """Rust ``parse_cpu_quantity``: a Kubernetes CPU quantity ("2", "1.5", "500m") rounded up."""
    raw = env.get(name)
    if raw is None:
        return None
    try:
        cores = rust_f64(raw[:-1]) / 1000 if raw.endswith("m") else rust_f64(raw)
    except ValueError as e:
        raise ConfigError(name, f"invalid value {raw!r} ({e})") from None
    if not math.isfinite(cores) or cores <= 0:
        raise ConfigError(name, "must be a positive CPU quantity")
    return math.ceil(cores)


def cpu_count(env: Mapping[str, str], available: Callable[[], int] = available_cpus) -> int:
    """Rust ``get_cpu_count``: ZTUNNEL_RESOURCE_CPU_LIMIT, else ZTUNNEL_CPU_LIMIT, else the CPUs
    the process may use."""
    limit = cpu_quantity(env, "ZTUNNEL_RESOURCE_CPU_LIMIT")
    if limit is not None:
        return limit
    raw = env.get("ZTUNNEL_CPU_LIMIT")
    if raw is not None:
        try:
            return rust_uint(raw, 64)  # usize
        except ValueError as e:
            raise ConfigError("ZTUNNEL_CPU_LIMIT", f"invalid value {raw!r} ({e})") from None
    return available()


def worker_threads(
    env: Mapping[str, str],
    concurrency: int | None,
    available: Callable[[], int] = available_cpus,
) -> int:
    """Rust ``num_worker_threads``: ``ZTUNNEL_WORKER_THREADS`` (N, 0 = all CPUs, or P%), else the
    proxy config's ``concurrency`` (0 = all CPUs), else ``default_worker_threads``; at least 1."""

    def cpus() -> int:
        return cpu_count(env, available)

    raw = env.get("ZTUNNEL_WORKER_THREADS")
    if raw is not None:
        name = "ZTUNNEL_WORKER_THREADS"
        if raw.endswith("%"):
            try:
                percent = rust_f64(raw[:-1])
            except ValueError as e:
                raise ConfigError(name, f"invalid percentage: {e}") from None
            if percent <= 0 or percent > 100:
                raise ConfigError(name, "percentage must be between 0 and 100")
            # (NaN passes Rust's check too, and its float-to-usize cast makes it 0, then 1)
            n = 1 if math.isnan(percent) else max(math.ceil(cpus() * percent / 100), 1)
        else:
            try:
                n = rust_uint(raw, 64)  # usize
            except ValueError as e:
                raise ConfigError(name, f"invalid number: {e}") from None
            if n == 0:
                n = cpus()
    elif concurrency is not None:
        n = concurrency if concurrency > 0 else cpus()
    else:  # default_worker_threads
        request = cpu_quantity(env, "ZTUNNEL_RESOURCE_CPU_REQUEST") or 0
        limit = cpu_quantity(env, "ZTUNNEL_RESOURCE_CPU_LIMIT")
        if limit is not None:
            n = max(limit, request)
        else:
            fraction = math.ceil(cpus() * DEFAULT_WORKER_THREAD_CPU_FRACTION)
            n = max(fraction, request, DEFAULT_WORKER_THREADS)
    return max(n, 1)
