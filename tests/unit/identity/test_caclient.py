"""Istio CA client against the fake istiod: issuance, renewal, outages, mismatches, impersonation."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from ztunnel.config import Config
from ztunnel.core.identity import Identity
from ztunnel.identity.caclient import CAError, IstioCAClient
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import CertificateMismatch, CertificateUnavailable, SecretManager
from ztunnel.testing.fakeistiod import ISTIOD_SAN, FakeIstiod

pytestmark = pytest.mark.timeout(30)

ALICE = Identity("cluster.local", "default", "alice")
BOB = Identity("cluster.local", "default", "bob")


def ca_config(istiod: FakeIstiod, **env: str) -> Config:
    base = {
        "CA_ADDRESS": istiod.address,
        "XDS_ADDRESS": "",
        "AUTH_TOKEN": "ztunnel-token",
        "CLUSTER_ID": "cluster-9",
    }
    base.update(env)
    return Config.from_env(base)


@contextlib.asynccontextmanager
async def ca_client(istiod: FakeIstiod, **env: str) -> AsyncIterator[IstioCAClient]:
    client = IstioCAClient.from_config(ca_config(istiod, **env))
    try:
        yield client
    finally:
        await client.close()


@pytest.mark.both_loops
async def test_issues_an_impersonated_certificate_in_shared_mode() -> None:
    async with (
        FakeIstiod() as istiod,
        ca_client(istiod, SECRET_TTL="1h", CA_HEADER_X_ROUTE="ca-blue") as client,
    ):
        cert = await client.sign(ALICE)
        assert cert.identity == ALICE
        assert cert.roots[0] == istiod.ca.root_cert
        lifetime = cert.not_after - cert.not_before
        assert dt.timedelta(minutes=59) <= lifetime <= dt.timedelta(hours=1, minutes=1)

        (rec,) = istiod.csrs
        assert rec.signed == ALICE
        assert rec.request.validity_duration == 3600
        meta = rec.request.metadata.fields
        assert set(meta) == {"ImpersonatedIdentity"}
        assert meta["ImpersonatedIdentity"].string_value == str(ALICE)
        assert rec.header("authorization") == "Bearer ztunnel-token"
        assert rec.header("clusterid") == "cluster-9"
        assert rec.header("x_route") == "ca-blue"

        # The CSR: P-256, SHA-256, empty subject, one critical URI SAN (the SPIFFE id).
        csr = x509.load_pem_x509_csr(rec.request.csr.encode())
        assert csr.subject == x509.Name([])
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        assert san.critical
        assert san.value.get_values_for_type(x509.UniformResourceIdentifier) == [str(ALICE)]

        # The same channel serves further requests, concurrently.
        certs = await asyncio.gather(*(client.sign(BOB) for _ in range(4)))
        assert {c.identity for c in certs} == {BOB}
        assert len({c.serial for c in certs}) == 4


async def test_no_impersonation_metadata_in_dedicated_mode() -> None:
    async with (
        FakeIstiod() as istiod,
        ca_client(
            istiod, PROXY_MODE="dedicated", PROXY_WORKLOAD_INFO="default/alice-0/alice"
        ) as client,
    ):
        assert not client.impersonate
        cert = await client.sign(ALICE)
        assert cert.identity == ALICE
        (rec,) = istiod.csrs
        assert not rec.request.HasField("metadata")
        assert rec.request.validity_duration == 86400  # SECRET_TTL default 24h
        assert rec.signed == ALICE  # signed from the CSR's own SAN


async def test_identity_mismatch_is_rejected() -> None:
    async with FakeIstiod() as istiod, ca_client(istiod) as client:
        istiod.ca_wrong_identity = BOB
        with pytest.raises(
            CertificateMismatch, match=r"for spiffe://cluster\.local/ns/default/sa/bob"
        ):
            await client.sign(ALICE)
        # Through the secret manager, the caller sees the mismatch as the cause.
        mgr = SecretManager(client, initial_backoff=0.05, max_backoff=0.1)
        try:
            with pytest.raises(CertificateUnavailable) as ei:
                await mgr.fetch_certificate(ALICE)
            assert isinstance(ei.value.__cause__, CertificateMismatch)
        finally:
            await mgr.close()


@pytest.mark.parametrize(
    ("transform", "match"),
    [
        (lambda chain: [], "empty certificate chain"),
        (lambda chain: chain[:1], "unusable certificate chain"),
        (lambda chain: [chain[0], "not a certificate"], "unusable certificate chain"),
    ],
)
async def test_unusable_responses_are_rejected(transform: object, match: str) -> None:
    async with FakeIstiod() as istiod, ca_client(istiod) as client:
        istiod.ca_chain_transform = transform  # type: ignore[assignment]
        with pytest.raises(CAError, match=match):
            await client.sign(ALICE)


async def test_refusal_and_bad_token_are_ca_errors(tmp_path: Path) -> None:
    async with FakeIstiod(accept_tokens=["good"]) as istiod:
        async with ca_client(istiod, AUTH_TOKEN="bad") as client:
            with pytest.raises(CAError, match="UNAUTHENTICATED"):
                await client.sign(ALICE)
        # An AUTH_TOKEN naming no file is the token itself (Rust StaticToken): refused by istiod.
        async with ca_client(istiod, AUTH_TOKEN=str(tmp_path / "missing")) as client:
            with pytest.raises(CAError, match="UNAUTHENTICATED"):
                await client.sign(ALICE)
        # A token file (it existed when the config was read) that is gone is a local error.
        token = tmp_path / "token"
        token.write_text("bad")
        async with ca_client(istiod, AUTH_TOKEN=str(token)) as client:
            token.unlink()
            with pytest.raises(CAError, match="does not exist"):
                await client.sign(ALICE)
            assert len(istiod.csrs) == 2  # that one never reached the CA
            token.write_text("good")  # the file is read on every call
            assert (await client.sign(ALICE)).identity == ALICE


async def test_renewal_at_half_life_through_the_secret_manager() -> None:
    async with FakeIstiod() as istiod, ca_client(istiod, SECRET_TTL="2s") as client:
        mgr = SecretManager(client, initial_backoff=0.05, max_backoff=0.2)
        try:
            first = await mgr.fetch_certificate(ALICE)
            assert first.not_after - first.not_before == dt.timedelta(seconds=2)
            async with asyncio.timeout(5):
                while (second := mgr.find_certificate(ALICE)) is first:
                    await asyncio.sleep(0.02)
            assert second is not None and second.serial != first.serial
            assert len(istiod.csrs) == 2
            # Renewed at half-life: after the first one's refresh point, before it expired.
            assert first.refresh_at <= second.not_before < first.not_after
        finally:
            await mgr.close()


@pytest.mark.both_loops
async def test_ca_outage_is_survived_on_the_old_certificate() -> None:
    istiod = FakeIstiod()
    await istiod.start()
    client = IstioCAClient.from_config(ca_config(istiod, SECRET_TTL="3s"))
    mgr = SecretManager(client, initial_backoff=0.05, max_backoff=0.1)
    try:
        first = await mgr.fetch_certificate(ALICE)
        port = istiod.port
        await istiod.stop()  # istiod goes away; the renewal at half-life (1.5 s) fails
        async with asyncio.timeout(5):
            while mgr.statuses()[0].error is None:
                await asyncio.sleep(0.02)
        status = mgr.statuses()[0]
        assert status.state == "Available" and "unreachable" in (status.error or "")
        assert await mgr.fetch_certificate(ALICE) is first  # still valid: still served
        await istiod.start(port=port)  # back before the old one expires
        async with asyncio.timeout(5):
            while (cert := await mgr.fetch_certificate(ALICE)) is first:
                await asyncio.sleep(0.02)
        assert cert.identity == ALICE and cert.not_after > first.not_after
        assert mgr.statuses()[0].error is None
    finally:
        await mgr.close()
        await client.close()
        await istiod.stop()


async def test_tls_and_root_rotation(tmp_path: Path) -> None:
    async with FakeIstiod(tls=True) as istiod:
        roots = tmp_path / "root-cert.pem"
        roots.write_text(LocalCA.ephemeral().root_pem)  # not istiod's root (yet)
        async with ca_client(istiod, CA_ROOT_CA=str(roots), ALT_CA_HOSTNAME=ISTIOD_SAN) as client:
            with pytest.raises(CAError, match="unreachable"):
                await client.sign(ALICE)
            roots.write_text(istiod.root_pem)  # the mounted root bundle is rotated
            cert = await client.sign(ALICE)
            assert cert.identity == ALICE


async def test_delay_is_bounded_by_the_call_timeout() -> None:
    async with FakeIstiod() as istiod:
        istiod.ca_delay = 2.0
        client = IstioCAClient.from_config(ca_config(istiod))
        client.call_timeout = 0.2
        try:
            with pytest.raises(CAError):
                await client.sign(ALICE)
        finally:
            await client.close()


def test_from_config_needs_a_ca_address() -> None:
    with pytest.raises(ValueError, match="CA_ADDRESS"):
        IstioCAClient.from_config(Config.from_env({"XDS_ADDRESS": ""}))
