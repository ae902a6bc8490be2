#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf stubs from proto/kvcraft/v1/*.proto.
# Must run with grpcio-tools pinned to the version in pyproject.toml's test extra
# (the stubs check the grpcio runtime version); tests/test_proto_stubs.py checks that
# the committed stubs match this output.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-proto}"
python -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/kvcraft/v1/*.proto
