#!/usr/bin/env bash
# The one test command: install dependencies, lint, type-check, run every test (netns tests too).
# Needs root (network namespaces, iptables).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
python3 -m ruff check ztunnel tests benchmarks
python3 -m ruff format --check ztunnel tests benchmarks
python3 -m mypy ztunnel
python3 -m mypy benchmarks/*.py
python3 -m pytest -q "$@"
