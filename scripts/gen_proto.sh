#!/usr/bin/env bash
# Regenerate the Python gRPC code in calid/v1/ from protos/calid/v1/calid.proto.
# tests/unit/test_proto.py fails when the committed code is stale.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. protos/calid/v1/calid.proto
echo "regenerated calid/v1/calid_pb2.py, calid_pb2.pyi, calid_pb2_grpc.py"
