"""The answer decision from the State, without any I/O (``istio/ztunnel:src/dns/server.rs``
``Store``): which service a name means for a client, and which addresses answer it.

``Resolver.resolve`` returns an :class:`Answer` (authoritative, maybe empty) or None when the
name is not ours and must be forwarded upstream.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ztunnel.core.addr import IPAddr
from ztunnel.dns import names
from ztunnel.dns.names import Alias, Name
from ztunnel.state.model import IPFamilies, Service, ServiceVisibility, Workload
from ztunnel.state.store import State

TYPE_A = 1
TYPE_AAAA = 28
TTL = 30  # server.rs DEFAULT_TTL_SECONDS
MEMO_SIZE = 1024  # per pod: a flood of distinct names can pin at most ~0.5 MiB here


@dataclass(frozen=True, slots=True)
class Answer:
    """An authoritative answer: an optional CNAME (requested name -> stripped name), then the
    addresses, owned by ``owner`` (the stripped name after a CNAME, else the requested name)."""

    cname: Name | None = None
    addresses: tuple[IPAddr, ...] = ()
    service: Service | None = field(default=None, compare=False)
    # Rust's DNS access-log result: "success", "no records", or (a host whose family does not
    # match the query) "service does not support this record type".
    result: str = field(default="success", compare=False)


@dataclass(frozen=True, slots=True)
class Match:
    service: Service
    name: Name  # the hostname (maybe a wildcard) that matched
    alias: Alias


def is_supported_type(qtype: int) -> bool:
    """Only A and AAAA are answered from state; every other type is forwarded
    (``is_record_type_supported``)."""
    return qtype in (TYPE_A, TYPE_AAAA)


def _is_type(ip: IPAddr, qtype: int) -> bool:
    return (ip.version == 4) == (qtype == TYPE_A)


class Resolver:
    """Answers for the clients of one DNS server (one pod in shared mode)."""

    def __init__(
        self,
        state: State,
        *,
        cluster_domain: str = "cluster.local",
        ipv6_enabled: bool = True,
        preferred_namespace: str = "",
        search: Callable[[Workload], list[Name]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.state = state
        self.domain = names.from_text(cluster_domain)
        self.svc_suffix = "." + names.to_text(names.SVC + self.domain)
        self.ipv6_enabled = ipv6_enabled
        self.preferred_namespace = preferred_namespace
        # Dedicated mode: resolv.conf's search list (SearchDomains::Static); shared mode
        # (None): the per-pod Kubernetes list (SearchDomains::Dynamic).
        self._search = search
        self._rng = rng or random.Random()
        # find_server by (client namespace, name), valid for one state generation: the hot
        # case (the same few names asked again and again) skips alias and wildcard expansion.
        self._memo: dict[tuple[str, Name], Match | None] = {}
        self._memo_gen = -1

    def search_domains(self, client: Workload) -> list[Name]:
        if self._search is not None:
            return self._search(client)
        return names.search_domains(client.namespace, self.domain)

    def resolve(self, client: Workload, qname: Name, qtype: int) -> Answer | None:
        """The answer for an A/AAAA query, or None: not ours, forward it (``Store::lookup``)."""
        m = self.find_server(client, qname)
        if m is None:
            return None
        if not self._family_allowed(m.service, qtype):
            # found, but not this family: empty NOERROR
            return Answer(service=m.service, result="service does not support this record type")
        addrs = self._addresses(client, m.service, qtype)
        if not addrs:
            return Answer(service=m.service, result="no records")
        cname = None
        if m.alias.stripped is not None and m.name[:1] != ("*",):
            cname = m.alias.stripped
        return Answer(cname=cname, addresses=tuple(addrs), service=m.service)

    def find_server(self, client: Workload, qname: Name) -> Match | None:
        gen = self.state.generation
        if gen != self._memo_gen or len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
            self._memo_gen = gen
        key = (client.namespace, qname)
        try:
            return self._memo[key]
        except KeyError:
            pass
        m = self._memo[key] = self._find_server(client, qname)
        return m

    def _find_server(self, client: Workload, qname: Name) -> Match | None:
        """``Store::find_server``: every alias, every wildcard of it, first hit wins."""
        aliases = names.get_aliases(
            qname, client.namespace, self.domain, self.search_domains(client)
        )
        for alias in aliases:
            for candidate in names.get_wildcards(alias.name):
                service = self._best_service(client, names.to_text(candidate))
                if service is not None:
                    return Match(service, candidate, alias)
        return None

    def _best_service(self, client: Workload, hostname: str) -> Service | None:
        found = self.state.find_services_by_hostname(hostname)
        if not found:
            return None
        # No VIP and not a Kubernetes headless service (by its domain): not ours, forward.
        # Then drop what the client's namespace may not see.
        cands = [
            s
            for s in found
            if (s.vips or s.hostname.endswith(self.svc_suffix))
            and (s.visibility is not ServiceVisibility.NAMESPACE or s.namespace == client.namespace)
        ]
        return find_best_match(cands, client.namespace, self.preferred_namespace)

    def _family_allowed(self, service: Service, qtype: int) -> bool:
        """``service_family_allowed``."""
        if not self.ipv6_enabled and qtype == TYPE_AAAA:
            return False
        if service.ip_families is IPFamilies.IPV4_ONLY and qtype == TYPE_AAAA:
            return False
        return not (service.ip_families is IPFamilies.IPV6_ONLY and qtype == TYPE_A)

    def _enabled(self, ip: IPAddr) -> bool:
        return ip.version == 4 or self.ipv6_enabled

    def _addresses(self, client: Workload, service: Service, qtype: int) -> list[IPAddr]:
        """``Store::get_addresses``: VIPs on the client's network, or for a headless service
        the first address of the type of each endpoint; in random order."""
        out: list[IPAddr] = []
        if not service.vips:
            for wl in self.state.endpoints(service):
                for ip in wl.addresses:
                    if _is_type(ip, qtype) and self._enabled(ip):
                        out.append(ip)
                        break
        else:
            for vip in service.vips:
                ip = vip.address
                if _is_type(ip, qtype) and vip.network == client.network and self._enabled(ip):
                    out.append(ip)
        self._rng.shuffle(out)
        return out


def find_best_match(
    services: list[Service], client_namespace: str, preferred_namespace: str
) -> Service | None:
    """``ServiceMatch::find_best_match``: the client's namespace wins at once; else the last
    canonical one; else one in the preferred namespace; else the first."""
    best: Service | None = None
    kind = 0  # 0 none, 1 first, 2 preferred, 3 canonical
    for s in services:
        if s.namespace == client_namespace:
            return s
        if s.canonical:
            best, kind = s, 3
        elif preferred_namespace and s.namespace == preferred_namespace and kind != 3:
            best, kind = s, 2
        elif kind == 0:
            best, kind = s, 1
    return best
