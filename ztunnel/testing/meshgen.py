"""A synthetic mesh of realistic shape, for scale benchmarks and tests (product code never imports
it).

``mesh(pods, services)`` makes what istiod would send for a cluster of that size: pods spread
over namespaces (about 50 pods each) and nodes (about 30 pods each), in deployments of 5 replicas
behind services with a VIP and two ports, each pod with the fields istiod fills in (uid, names,
canonical labels, service account, node, cluster, locality, HBONE, its service's port map), plus
a few policies. Addresses come from 10.128.0.0/10 (pods) and 10.64.0.0/12 (VIPs), clear of the
test bed's own ranges. Deterministic: the same sizes give the same mesh.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ztunnel.state.model import (
    Authorization,
    Clause,
    Locality,
    Match,
    NetworkAddress,
    PolicyAction,
    PolicyScope,
    Rule,
    Service,
    ServiceAccountMatch,
    ServicePort,
    TunnelProtocol,
    Workload,
)

__all__ = ["Mesh", "mesh", "pod", "pod_ip", "service", "vip"]

PODS_PER_NAMESPACE = 50
PODS_PER_NODE = 30
REPLICAS = 5
_POD_BASE = int(ipaddress.IPv4Address("10.128.0.0"))
_VIP_BASE = int(ipaddress.IPv4Address("10.64.0.0"))
_ZONES = ("us-central1-a", "us-central1-b", "us-central1-c")


@dataclass(frozen=True)
class Mesh:
    workloads: list[Workload]
    services: list[Service]
    policies: list[Authorization]


def pod_ip(i: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(_POD_BASE + 1 + i)


def vip(j: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(_VIP_BASE + 1 + j)


def _namespace(i: int) -> str:
    return f"team-{i // PODS_PER_NAMESPACE:04d}"


def _service_of(i: int, services: int) -> int:
    return (i // REPLICAS) % services if services else -1


def service(j: int) -> Service:
    ns = _namespace(j * REPLICAS)
    name = f"svc-{j:05d}"
    return Service(
        name=name,
        namespace=ns,
        hostname=f"{name}.{ns}.svc.cluster.local",
        vips=(NetworkAddress("", vip(j)),),
        ports=(ServicePort(80, 8080), ServicePort(9090, 9090)),
    )


def pod(i: int, services: int, *, generation: int = 0) -> Workload:
    """Pod ``i`` (``generation`` > 0: a new replica that replaced it, as a rollout makes)."""
    ns = _namespace(i)
    deploy = f"app-{i // REPLICAS:05d}"
    suffix = f"{(i * 2654435761 + generation * 97) % 0xFFFFFF:06x}"
    name = f"{deploy}-7d9f8c5b6-{suffix}"
    j = _service_of(i, services)
    svc_map = {}
    if j >= 0:
        s = service(j)
        svc_map = {s.key: {80: 8080, 9090: 9090}}
    node = f"gke-prod-pool-{i // (PODS_PER_NODE * 100):02d}-node-{i // PODS_PER_NODE:05d}"
    return Workload(
        uid=f"Kubernetes//Pod/{ns}/{name}",
        name=name,
        namespace=ns,
        addresses=(pod_ip(i),),
        protocol=TunnelProtocol.HBONE,
        trust_domain="cluster.local",
        service_account=f"sa-{deploy}",
        node=node,
        canonical_name=deploy,
        canonical_revision="v1",
        workload_type="pod",
        workload_name=deploy,
        services=svc_map,
        cluster_id="Kubernetes",
        locality=Locality("us-central1", _ZONES[i // PODS_PER_NODE % 3], ""),
    )


def _policy(k: int) -> Authorization:
    ns = _namespace(k * PODS_PER_NAMESPACE)
    return Authorization(
        name=f"allow-{k}",
        namespace=ns,
        scope=PolicyScope.NAMESPACE,
        action=PolicyAction.ALLOW,
        rules=(
            Rule(
                (
                    Clause(
                        (
                            Match(
                                service_accounts=(ServiceAccountMatch(ns, f"sa-app-{k:05d}"),),
                                destination_ports=(8080,),
                            ),
                        )
                    ),
                )
            ),
        ),
    )


def mesh(pods: int, services: int, policies: int = 10) -> Mesh:
    return Mesh(
        [pod(i, services) for i in range(pods)],
        [service(j) for j in range(services)],
        [_policy(k) for k in range(policies)],
    )
