"""Secret manager: one certificate per node-local identity, fetched once, renewed at half-life.

Invariants: at most one CA request per identity is in flight (single-flight, including renewals);
at most ``concurrency`` (8) CA requests run at once; a still-valid certificate is served while its
renewal fails and is retried with exponential backoff. Every background task belongs to the
``SecretManager`` and ``close()`` ends them all. All methods except ``find_certificate`` must be
called from the event loop that runs the manager.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from ztunnel.core.identity import Identity

from .certs import WorkloadCertificate
from .tls import TLS_POLICY_MEMO, TlsPolicy

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 8
DEFAULT_INITIAL_BACKOFF = 0.5
DEFAULT_MAX_BACKOFF = 150.0
DEFAULT_REQUEST_TIMEOUT = 60.0


class CertificateProvider(Protocol):
    """Something that returns a signed certificate for an identity: the local CA, istiod's CA."""

    async def sign(self, identity: Identity) -> WorkloadCertificate: ...


class CertificateSource(Protocol):
    """What the data plane asks for certificates: a ``SecretManager``, or in a data-plane worker
    the supervisor's manager over the worker channel (ztunnel/workers)."""

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate: ...


class CertificateError(Exception):
    """Base of the errors ``SecretManager.fetch_certificate`` raises."""


class CertificateUnavailable(CertificateError):
    """No valid certificate: the last CA request failed (``__cause__`` holds why)."""

    def __init__(self, identity: Identity, cause: BaseException) -> None:
        super().__init__(f"no certificate for {identity}: {cause}")
        self.identity = identity


class CertificateForgotten(CertificateError):
    """The identity was forgotten (left the node) while a caller waited for its certificate."""

    def __init__(self, identity: Identity) -> None:
        super().__init__(f"certificate for {identity} was forgotten")
        self.identity = identity


class SecretManagerClosed(CertificateError):
    """The manager is closed."""


class CertificateMismatch(CertificateError):
    """The CA returned a certificate for another identity (or an already expired one)."""


@dataclass(frozen=True, slots=True)
class CertificateStatus:
    """One managed identity, for admin dumps."""

    identity: Identity
    state: Literal["Initializing", "Available", "Unavailable"]
    certificate: WorkloadCertificate | None
    error: str | None


class _Entry:
    """Per-identity state. ``attempt`` is set while a CA request is in flight; its event fires
    when that request ends (success, failure or cancellation)."""

    __slots__ = ("attempt", "backoff", "cert", "error", "gone", "identity", "task")

    def __init__(self, identity: Identity, backoff: float) -> None:
        self.identity = identity
        self.cert: WorkloadCertificate | None = None
        self.error: BaseException | None = None
        self.attempt: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.gone = False
        self.backoff = backoff


class SecretManager:
    """Caches workload certificates per ``Identity`` on top of a ``CertificateProvider``.

    ``clock`` gives the wall time (UNIX seconds; certificate validity is wall time) and ``sleep``
    waits; both are injectable so tests can drive renewal with a fake clock.
    """

    def __init__(
        self,
        provider: CertificateProvider,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        initial_backoff: float = DEFAULT_INITIAL_BACKOFF,
        max_backoff: float = DEFAULT_MAX_BACKOFF,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        tls_policy: TlsPolicy | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if not 0 < initial_backoff <= max_backoff:
            raise ValueError("need 0 < initial_backoff <= max_backoff")
        self._provider = provider
        self._limit = asyncio.Semaphore(concurrency)
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._request_timeout = request_timeout
        self._clock = clock
        self._sleep = sleep
        self._tls_policy = tls_policy
        self._entries: dict[Identity, _Entry] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        # Told of every certificate obtained (first fetch and renewals) and every forgotten
        # identity: the supervisor pushes them to its data-plane workers.
        self.on_certificate: Callable[[Identity, WorkloadCertificate], None] | None = None
        self.on_forget: Callable[[Identity], None] | None = None

    # -- public API -----------------------------------------------------------------------------

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        """The current valid certificate for ``identity``, fetching it first if needed.

        Concurrent callers share one CA request. Raises ``CertificateUnavailable`` when there is
        no valid certificate and the last request failed (retries continue in the background),
        ``CertificateForgotten`` if the identity is forgotten meanwhile, ``SecretManagerClosed``.
        """
        entry = self._entries.get(identity)
        if entry is None:
            entry = self._start(identity)
        while True:
            if self._closed:
                raise SecretManagerClosed("secret manager is closed")
            if entry.gone:
                raise CertificateForgotten(identity)
            cert = entry.cert
            if cert is not None and not cert.is_expired(self._clock()):
                return cert
            if entry.attempt is not None:
                await entry.attempt.wait()
                continue
            if entry.error is not None:
                raise CertificateUnavailable(identity, entry.error) from entry.error
            # Expired, no request in flight and no error: the renewal timer is late (suspend,
            # wall-clock jump; the loop's timers are monotonic). Renew now.
            log.warning("certificate for %s expired before its renewal ran; renewing now", identity)
            self._spawn(entry)

    def find_certificate(self, identity: Identity) -> WorkloadCertificate | None:
        """The cached certificate if it is still valid; never waits, never fetches."""
        entry = self._entries.get(identity)
        cert = entry.cert if entry is not None else None
        if cert is None or cert.is_expired(self._clock()):
            return None
        return cert

    def prefetch(self, identity: Identity) -> None:
        """Start managing ``identity`` (warm-up for node-local workloads) without waiting."""
        if identity not in self._entries:
            self._start(identity)

    def forget(self, identity: Identity) -> None:
        """Drop ``identity`` (its last workload left the node): cancel its renewal, fail waiters."""
        entry = self._entries.pop(identity, None)
        if entry is not None:
            self._stop(entry)
            if self.on_forget is not None:
                self.on_forget(identity)

    def identities(self) -> list[Identity]:
        return sorted(self._entries)

    def statuses(self) -> list[CertificateStatus]:
        """A snapshot of every managed identity, sorted, for /config_dump."""
        out = []
        for ident in sorted(self._entries):
            e = self._entries[ident]
            err = None if e.error is None else str(e.error) or type(e.error).__name__
            if e.cert is not None and not e.cert.is_expired(self._clock()):
                out.append(CertificateStatus(ident, "Available", e.cert, err))
            elif e.error is not None:
                out.append(CertificateStatus(ident, "Unavailable", e.cert, err))
            else:
                out.append(CertificateStatus(ident, "Initializing", e.cert, None))
        return out

    async def close(self) -> None:
        """Cancel every task and wait for them to finish; later fetches raise. Idempotent."""
        self._closed = True
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            self._stop(entry)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- internals ------------------------------------------------------------------------------

    def _start(self, identity: Identity) -> _Entry:
        if self._closed:
            raise SecretManagerClosed("secret manager is closed")
        entry = _Entry(identity, self._initial_backoff)
        self._entries[identity] = entry
        self._spawn(entry)
        return entry

    def _spawn(self, entry: _Entry) -> None:
        """(Re)start the entry's task, which begins with a CA request."""
        if entry.task is not None:
            entry.task.cancel()
        # Marked in flight before the task first runs, so callers wait instead of spinning.
        entry.attempt = asyncio.Event()
        task = asyncio.get_running_loop().create_task(
            self._run(entry), name=f"secret-manager:{entry.identity}"
        )
        entry.task = task
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _stop(self, entry: _Entry) -> None:
        entry.gone = True
        if entry.task is not None:
            entry.task.cancel()
        # Wake waiters even if the task never got to run (its finally block would do it).
        if entry.attempt is not None:
            entry.attempt.set()
            entry.attempt = None

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("certificate task %s died", task.get_name(), exc_info=task.exception())

    async def _run(self, entry: _Entry) -> None:
        """Fetch, then renew at half-life forever; back off on failure. Ends only by cancel."""
        while True:
            event = entry.attempt
            if event is None:
                event = entry.attempt = asyncio.Event()
            try:
                cert = await self._request(entry.identity)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = self._on_failure(entry, e)
            else:
                delay = self._on_success(entry, cert)
            finally:
                if entry.attempt is event:
                    entry.attempt = None
                event.set()
            await self._sleep(delay)

    async def _request(self, identity: Identity) -> WorkloadCertificate:
        async with self._limit, asyncio.timeout(self._request_timeout):
            cert = await self._provider.sign(identity)
        if cert.identity != identity:
            raise CertificateMismatch(
                f"CA returned a certificate for {cert.identity}, asked for {identity}"
            )
        if cert.is_expired(self._clock()):
            raise CertificateMismatch(
                f"CA returned an expired certificate (not_after {cert.not_after})"
            )
        if self._tls_policy is not None:
            policy = self._tls_policy
            cert.memo(TLS_POLICY_MEMO, lambda: policy)  # before any context is built from it
        return cert

    def _next_backoff(self, entry: _Entry) -> float:
        delay = entry.backoff
        entry.backoff = min(entry.backoff * 2, self._max_backoff)
        return delay

    def _on_success(self, entry: _Entry, cert: WorkloadCertificate) -> float:
        entry.cert = cert
        entry.error = None
        if self.on_certificate is not None:
            self.on_certificate(entry.identity, cert)
        delay = cert.refresh_at.timestamp() - self._clock()
        if delay > 0:
            entry.backoff = self._initial_backoff
            log.debug(
                "certificate for %s valid until %s, renewing in %.1fs",
                entry.identity,
                cert.not_after,
                delay,
            )
            return delay
        # Already past half-life on arrival (very short TTL, clock skew): renew, but not in a
        # tight loop against the CA.
        delay = self._next_backoff(entry)
        log.warning(
            "certificate for %s is already past half-life; renewing in %.1fs", entry.identity, delay
        )
        return delay

    def _on_failure(self, entry: _Entry, error: Exception) -> float:
        entry.error = error
        delay = self._next_backoff(entry)
        still_valid = entry.cert is not None and not entry.cert.is_expired(self._clock())
        log.warning(
            "certificate request for %s failed (%s: %s); %s; retrying in %.1fs",
            entry.identity,
            type(error).__name__,
            error,
            "keeping the still-valid certificate" if still_valid else "no valid certificate",
            delay,
        )
        return delay
