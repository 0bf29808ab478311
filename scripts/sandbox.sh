#!/usr/bin/env bash
# The main job: install what is needed, then build the sandbox mesh and send traffic through it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
exec python3 -m ztunnel.testing.sandbox "$@"
