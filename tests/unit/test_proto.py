"""The committed gRPC code in calid/v1 must match protos/calid/v1/calid.proto (regenerate: scripts/gen_proto.sh)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["calid_pb2.py", "calid_pb2.pyi", "calid_pb2_grpc.py"]


def test_generated_code_is_current(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                      f"--pyi_out={tmp_path}", str(ROOT / "protos/calid/v1/calid.proto")])
    assert rc == 0
    stale = [name for name in GENERATED
             if (tmp_path / "calid/v1" / name).read_text() != (ROOT / "calid/v1" / name).read_text()]
    assert not stale, f"calid/v1/{stale} is stale: run scripts/gen_proto.sh and commit the result"


def test_service_has_the_promised_methods():
    from calid.v1 import calid_pb2 as pb

    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Calid"].methods}
    assert methods == {"Generate", "GenerateStream", "Health", "ListModels", "Cancel", "Collaborate"}
    stream = pb.DESCRIPTOR.services_by_name["Calid"].methods_by_name["GenerateStream"]
    assert stream.server_streaming and not stream.client_streaming
    bidi = pb.DESCRIPTOR.services_by_name["Calid"].methods_by_name["Collaborate"]
    assert bidi.server_streaming and bidi.client_streaming
