from protos import common_pb2 as _common_pb2
from protos import kv_control_pb2 as _kv_control_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "target", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    target: _kv_control_pb2.KvTarget
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., target: _Optional[_Union[_kv_control_pb2.KvTarget, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first", "done")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    first: _common_pb2.TokenChunk
    done: _kv_control_pb2.TransferDone
    def __init__(self, first: _Optional[_Union[_common_pb2.TokenChunk, _Mapping]] = ..., done: _Optional[_Union[_kv_control_pb2.TransferDone, _Mapping]] = ...) -> None: ...
