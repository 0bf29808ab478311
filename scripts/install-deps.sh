#!/usr/bin/env bash
# Install everything the tests, the sandbox and the benchmarks need, on Debian, as root.
# Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

# iptables/iproute2 (ip, ss): the netns test bed; nodejs: the HBONE interop tests (Node's http2);
# haproxy, iperf3, stunnel4: the benchmarks' peers and load; golang-go: the Go stand-in for
# istioctl's config_dump decoder (tests/golden/istioctl) and `go tool pprof` for the profiles.
# tmux: a real terminal for `ztunnel top`.
# bind9-dnsutils (dig), dnsmasq-base (the binary only: no service, never touches the host's
# resolver), dnsperf: the DNS proxy's tests and benchmark. util-linux (setpriv): a ztunnel
# started without capabilities (the in-pod start-up check's test).
# curl: a real SOCKS5 client (--socks5, --socks5-hostname) for the SOCKS5 listener tests.
APT_PACKAGES=(iptables iproute2 ipset haproxy iperf3 stunnel4 procps openssl golang-go tmux
  bind9-dnsutils dnsmasq-base dnsperf util-linux curl)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node may come with the machine image rather than from Debian: only install it when absent.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Every Python package any checked file imports is declared in pyproject.toml: the package's own
# dependencies, the test tools (dev) and the benchmarks' plotting (bench, type-checked by mypy).
python3 -m pip install -q --disable-pip-version-check -e ".[dev,bench]"
