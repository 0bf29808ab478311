#!/usr/bin/env bash
# The one test command: install dependencies, lint, type-check, run every test (netns tests too).
# Needs root (network namespaces, iptables).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
python3 -m ruff check ztunnel tests benchmarks fuzz
python3 -m ruff format --check ztunnel tests benchmarks fuzz
python3 -m mypy ztunnel
python3 -m mypy benchmarks/*.py fuzz/*.py
# Everything with two data-plane workers (Rust's default worker count on any machine), then the
# netns suite again with one (the single-process ztunnel), unless a selection was given.
ZTUNNEL_WORKER_THREADS=2 python3 -m pytest -q "$@"
if [ $# -eq 0 ]; then
    ZTUNNEL_WORKER_THREADS=1 python3 -m pytest -q tests/netns
fi
