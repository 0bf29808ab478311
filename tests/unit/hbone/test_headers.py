import dataclasses

from ztunnel.core.addr import SocketAddr
from ztunnel.hbone.headers import (
    Baggage,
    baggage,
    forwarded,
    forwarded_host,
    new_traceparent,
    parse_baggage,
    request_headers,
    valid_traceparent,
)
from ztunnel.state.model import Locality, Workload


def wl(**kw: object) -> Workload:
    base: dict[str, object] = {"uid": "u", "name": "p", "namespace": "ns"}
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


def test_baggage_only_non_empty_fields_in_order() -> None:
    w = wl(
        workload_name="reviews-v1",
        workload_type="deployment",
        canonical_name="reviews",
        canonical_revision="v1",
        locality=Locality(region="r1", zone="z1"),
    )
    assert baggage(w) == (
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=ns,k8s.deployment.name=reviews-v1,"
        "service.name=reviews,service.version=v1,cloud.region=r1,cloud.availability_zone=z1"
    )
    assert baggage(wl(workload_type="cronjob", workload_name="c", cluster_id="")) == (
        "k8s.namespace.name=ns,k8s.cronjob.name=c"
    )
    assert baggage(None) == ""


def test_baggage_is_computed_once_per_workload_object() -> None:
    # Memoised per workload object: an updated workload (a new frozen object, as a state
    # update brings) gets its own value.
    w = wl(workload_name="a", workload_type="pod", cluster_id="")
    assert baggage(w) == baggage(w) == "k8s.namespace.name=ns,k8s.pod.name=a"
    updated = dataclasses.replace(w, namespace="other")
    assert baggage(updated) == "k8s.namespace.name=other,k8s.pod.name=a"
    assert baggage(w) == "k8s.namespace.name=ns,k8s.pod.name=a"


def test_baggage_roundtrip_and_lenient_parse() -> None:
    w = wl(workload_name="job1", workload_type="job", canonical_name="svc")
    b = parse_baggage(baggage(w))
    assert b == Baggage(
        cluster_id="Kubernetes",
        namespace="ns",
        workload_name="job1",
        workload_type="job",
        service_name="svc",
    )
    assert parse_baggage("garbage,,=x,k8s.namespace.name=a;prop=1, service.name = s ") == Baggage(
        namespace="a", service_name="s"
    )
    assert parse_baggage(None) == Baggage()


def test_forwarded() -> None:
    assert forwarded(SocketAddr.parse("10.0.0.1:4567")) == 'for="10.0.0.1:4567"'
    assert forwarded(SocketAddr.parse("[fd00::1]:1"), "a.b.svc.cluster.local") == (
        'for="[fd00::1]:1";host=a.b.svc.cluster.local'
    )
    assert forwarded_host('for="1.2.3.4:5";host=x.y') == "x.y"
    assert forwarded_host('for="1.2.3.4:5"') is None
    assert forwarded_host(None) is None


def test_traceparent() -> None:
    t = new_traceparent()
    assert len(t) == 55 and valid_traceparent(t)
    assert new_traceparent() != t
    assert not valid_traceparent("00-xyz")
    assert not valid_traceparent(None)
    assert not valid_traceparent(t.upper())


def test_request_headers() -> None:
    h = dict(request_headers(wl(), SocketAddr.parse("1.2.3.4:5"), service_hostname=None))
    assert h["forwarded"] == 'for="1.2.3.4:5"'
    assert h["baggage"] == "k8s.cluster.name=Kubernetes,k8s.namespace.name=ns"
    assert valid_traceparent(h["traceparent"])
