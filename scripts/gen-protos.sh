#!/usr/bin/env bash
# Regenerate the protobuf Python modules (*_pb2.py + .pyi) from the .proto files in the tree:
# ztunnel/inpod/zds.proto and ztunnel/xds/protos/*.proto.
#
# Dev-time only: grpcio-tools (which bundles protoc) goes into a throwaway venv, so it never
# becomes a runtime dependency and never changes the protobuf runtime installed for the project.
# GRPCIO_TOOLS pins the compiler: its protoc version is the "gencode" version written into the
# generated files, and the protobuf runtime must be at least that version (see the `protobuf`
# line in pyproject.toml). grpcio-tools 1.85.1 bundles libprotoc 35.1 = gencode 7.35.1.
set -euo pipefail
cd "$(dirname "$0")/.."

GRPCIO_TOOLS="${GRPCIO_TOOLS:-grpcio-tools==1.85.1}"
VENV="$(mktemp -d /tmp/gen-protos.XXXXXX)"
trap 'rm -rf "$VENV"' EXIT

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "$GRPCIO_TOOLS"

# Every proto is compiled from the repo root so each registers under a unique name (e.g.
# "ztunnel/inpod/zds.proto", "ztunnel/xds/protos/workload.proto") in the process-wide descriptor
# pool, and never collides with another project's "zds.proto" or "workload.proto".
"$VENV/bin/python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. ztunnel/inpod/zds.proto

# The control-plane protos: xDS envelope, Address, Authorization, CA.
XDS_PROTOS=(discovery workload authorization ca)
"$VENV/bin/python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
  $(printf "ztunnel/xds/protos/%s.proto " "${XDS_PROTOS[@]}")

"$VENV/bin/python" -m grpc_tools.protoc --version
echo "generated: ztunnel/inpod/zds_pb2.py ztunnel/inpod/zds_pb2.pyi"
echo "generated: $(printf "ztunnel/xds/protos/%s_pb2.py[i] " "${XDS_PROTOS[@]}")"
