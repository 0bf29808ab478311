#!/usr/bin/env bash
# Install everything the tests, the sandbox and the benchmarks need, on Debian, as root.
# Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(iptables iproute2 ipset haproxy iperf3 stunnel4 procps)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -e ".[dev]"
