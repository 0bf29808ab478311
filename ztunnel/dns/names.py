"""Pure name logic: Kubernetes short-name expansion, search-domain stripping, wildcards.

A name is a tuple of lower-case labels without the root (``("svc", "ns", "svc", "cluster",
"local")``). Functions mirror ``istio/ztunnel:src/dns/server.rs`` (``to_kube_fqdns``,
``get_aliases``, ``get_wildcards``) and ``src/dns/name_util.rs`` (``has_domain``,
``trim_domain``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

Name = tuple[str, ...]

SVC: Name = ("svc",)

# Labels we compare with state hostnames. Anything else (a dot or a space inside a label, non-
# ASCII bytes) can never equal a hostname's label, so such a name is simply not ours.
_LABEL = re.compile(r"[a-z0-9_*-]{1,63}")


def from_text(text: str) -> Name:
    """``"a.B.c."`` -> ``("a", "b", "c")``; the empty name and ``"."`` are the root ``()``."""
    t = text.strip().lower().rstrip(".")
    return tuple(t.split(".")) if t else ()


def to_text(name: Name) -> str:
    """The state's hostname form (no trailing dot)."""
    return ".".join(name)


def from_wire_labels(labels: tuple[bytes, ...]) -> Name | None:
    """Labels as dnspython gives them (root label last) -> a Name, or None when a label cannot
    occur in a hostname we serve."""
    out: list[str] = []
    for raw in labels:
        if not raw:
            continue
        try:
            label = raw.decode("ascii").lower()
        except UnicodeDecodeError:
            return None
        if not _LABEL.fullmatch(label):
            return None
        out.append(label)
    return tuple(out)


def has_domain(name: Name, domain: Name) -> bool:
    """``name`` ends with ``domain`` and has more labels (``name_util.rs`` ``has_domain``)."""
    if (domain and domain[0] == "*") or len(name) <= len(domain):
        return False
    return name[len(name) - len(domain) :] == domain


def trim_domain(name: Name, domain: Name) -> Name | None:
    """``name`` without ``domain`` if it ends with it (``name_util.rs`` ``trim_domain``)."""
    if has_domain(name, domain):
        return name[: len(name) - len(domain)]
    return None


def to_kube_fqdns(name: Name, client_namespace: str, cluster_domain: Name) -> list[Name]:
    """The Kubernetes FQDNs a short name can mean for a client in ``client_namespace``
    (``server.rs`` ``Store::to_kube_fqdns``)."""
    svc_domain = SVC + cluster_domain
    namespaced = (client_namespace, *svc_domain)
    n = len(name)
    if n == 1:
        return [name + namespaced]  # <svc> -> <svc>.<ns>.svc.<cd>
    if n == 2:
        # <svc>.<ns> -> <svc>.<ns>.svc.<cd>; <pod>.<subdomain> -> ...<client ns>.svc.<cd>
        return [name + svc_domain, name + namespaced]
    if n == 3:
        out = []
        if has_domain(name, SVC):
            out.append(name + cluster_domain)  # <svc>.<ns>.svc
        out.append(name + svc_domain)  # <pod>.<subdomain>.<ns>
        return out
    if n == 4 and has_domain(name, SVC):
        return [name + cluster_domain]  # <pod>.<subdomain>.<ns>.svc
    return []


@dataclass(frozen=True, slots=True)
class Alias:
    """A name to look up for a request, and the stripped name it came from (for the CNAME)."""

    name: Name
    stripped: Name | None = None


def search_domains(client_namespace: str, cluster_domain: Name) -> list[Name]:
    """The per-pod Kubernetes search list assumed in shared mode (``SystemForwarder``
    ``search_domains``, ``SearchDomains::Dynamic``)."""
    return [(client_namespace, *SVC, *cluster_domain), SVC + cluster_domain, cluster_domain]


def get_aliases(
    name: Name, client_namespace: str, cluster_domain: Name, search: list[Name]
) -> Iterator[Alias]:
    """Every alias of ``name`` from the client's point of view, first seen first, no duplicate
    names (``server.rs`` ``Store::get_aliases``); lazily, since the first hit ends the search."""
    yield Alias(name)
    seen: set[Name] = {name}
    for fqdn in to_kube_fqdns(name, client_namespace, cluster_domain):
        if fqdn not in seen:
            seen.add(fqdn)
            yield Alias(fqdn)
    for domain in search:
        stripped = trim_domain(name, domain)
        if stripped is None:
            continue
        if stripped not in seen:
            seen.add(stripped)
            yield Alias(stripped, stripped)
        for fqdn in to_kube_fqdns(stripped, client_namespace, cluster_domain):
            if fqdn not in seen:
                seen.add(fqdn)
                yield Alias(fqdn, stripped)


def get_wildcards(name: Name) -> list[Name]:
    """``name``, then ``*.`` over each parent with more than one label left (``server.rs``
    ``get_wildcards``): ``a.b.c`` -> ``a.b.c``, ``*.b.c``, ``*.c``."""
    out = [name]
    rest = name
    while len(rest) > 1:
        out.append(("*", *rest[1:]))
        rest = rest[1:]
    return out
