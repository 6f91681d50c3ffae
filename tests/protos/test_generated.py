"""The committed protobuf modules are what the .proto files compile to now (``make protos``
after every .proto change), and they import with the protobuf runtime installed here."""

from __future__ import annotations

import importlib
import pathlib
from collections.abc import Iterable

import pytest
from google.protobuf import descriptor_pb2

from protos.build import PROTOS, ROOT


def _without_json_names(msgs: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    """protoc's descriptor sets name every field's JSON form; Python gencode leaves it out."""
    for m in msgs:
        for f in m.field:
            f.ClearField("json_name")
        _without_json_names(m.nested_type)


@pytest.mark.parametrize("proto", PROTOS)
def test_generated_module_matches_its_proto(proto: str, tmp_path: pathlib.Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={out}", proto]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _without_json_names(fresh.message_type)
    module = importlib.import_module(proto.removesuffix(".proto").replace("/", ".") + "_pb2")
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert committed == fresh, f"{proto} changed since its _pb2 module was generated: make protos"
