"""The command line: ``ztunnel version`` and ``ztunnel explain`` (exit 0 allowed, 1 denied,
2 bad input)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ztunnel import __version__
from ztunnel.cli import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, main

pytestmark = pytest.mark.timeout(30)

CONFIG = """
workloads:
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  trustDomain: cluster.local
  workloadIps: ["10.2.0.2"]
  protocol: HBONE
policies:
- name: strict
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - notPrincipals: [{Presence: []}]
- name: deny-9999
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - destinationPorts: [9999]
"""

CLIENT = "spiffe://cluster.local/ns/default/sa/client"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "local.yaml"
    path.write_text(CONFIG)
    return path


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["version"] == __version__
    # Rust version(): BuildInfo's Display, one line.
    assert main(["version"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith(f'version.BuildInfo{{Version:"{__version__}", GitRevision:"')
    assert out.endswith('"}\n') and out.count("\n") == 1


def test_an_unknown_command_prints_the_help_and_exits_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Rust main: "unknown command: X" on stderr, help() on stdout, process::exit(1).
    assert main(["frobnicate"]) == EXIT_FAILURE
    got = capsys.readouterr()
    assert got.err == "unknown command: frobnicate\n"
    assert "Istio Ztunnel (version.BuildInfo{" in got.out and "proxy (default)" in got.out


def test_a_bad_setting_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rust main: parse_config's error is returned, so the exit code is 1.
    monkeypatch.setenv("PROXY_MODE", "Dedicated")
    assert main(["proxy"]) == EXIT_FAILURE
    assert "invalid configuration: PROXY_MODE" in capsys.readouterr().err


def test_explain_allowed(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "explain",
            "--config",
            str(config),
            "--src",
            CLIENT,
            "--dst",
            "default/server",
            "--port",
            "8080",
        ]
    )
    out = capsys.readouterr().out
    assert rc == EXIT_OK
    assert "decision:    ALLOW: no allow policies" in out
    assert "DENY  default/strict (namespace): no match" in out


def test_explain_denied_plaintext_and_port(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Plaintext (an IP has no identity): the STRICT-style DENY matches.
    rc = main(
        [
            "explain",
            "--config",
            str(config),
            "--src",
            "10.1.0.2",
            "--dst",
            "10.2.0.2",
            "--port",
            "80",
        ]
    )
    out = capsys.readouterr().out
    assert rc == EXIT_FAILURE
    assert "decision:    DENY: explicitly denied by: default/strict" in out
    assert "source:      plaintext (no identity) from 10.1.0.2" in out
    rc = main(
        [
            "explain",
            "--config",
            str(config),
            "--src",
            CLIENT,
            "--dst",
            "cluster1//v1/Pod/default/server",
            "--port",
            "9999",
            "--json",
        ]
    )
    body = json.loads(capsys.readouterr().out)
    assert rc == EXIT_FAILURE
    assert body["decision"]["policy"] == "default/deny-9999"
    assert [p["matched"] for p in body["policies"]] == [False, True]


def test_explain_config_from_env(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_XDS_PATH", str(config))
    assert main(["explain", "--src", CLIENT, "--dst", "default/server", "--port", "1"]) == EXIT_OK
    capsys.readouterr()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dst", "default/ghost", "--port", "80"], "no workload 'default/ghost'"),
        (["--dst", "default/server", "--port", "x"], "invalid port 'x'"),
        (["--dst", "default/server", "--port", "80", "--src", "spiffe://bad"], "is not spiffe://"),
    ],
)
def test_explain_bad_input(
    config: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["explain", "--config", str(config), *args]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("ztunnel explain: ") and message in err


def test_explain_bad_or_missing_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_XDS_PATH", raising=False)
    assert main(["explain", "--dst", "a/b", "--port", "1"]) == EXIT_CONFIG
    assert "--config (or LOCAL_XDS_PATH) is required" in capsys.readouterr().err
    missing = tmp_path / "nope.yaml"
    assert main(["explain", "--config", str(missing), "--dst", "a/b", "--port", "1"]) == EXIT_CONFIG
    assert "nope.yaml" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads:\n- name: x\n  bogus: 1\n")
    assert main(["explain", "--config", str(bad), "--dst", "a/b", "--port", "1"]) == EXIT_CONFIG
    assert "bad.yaml:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: a required option is missing
        main(["explain", "--config", str(bad), "--port", "1"])
    assert exc.value.code == EXIT_CONFIG


def test_explain_entry_point(config: Path) -> None:
    """``python -m ztunnel explain``: the real process, its exit status and output."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    base = [
        sys.executable,
        "-m",
        "ztunnel",
        "explain",
        "--config",
        str(config),
        "--dst",
        "default/server",
    ]
    ok = subprocess.run(
        [*base, "--src", CLIENT, "--port", "80"],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
        check=False,
    )
    assert ok.returncode == EXIT_OK, ok.stderr
    assert "ALLOW" in ok.stdout
    denied = subprocess.run(
        [*base, "--port", "80"], capture_output=True, text=True, env=env, timeout=20, check=False
    )
    assert denied.returncode == EXIT_FAILURE, denied.stderr
    assert "explicitly denied by: default/strict" in denied.stdout
