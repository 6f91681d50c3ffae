from protos import common_pb2 as _common_pb2
from protos import kv_control_pb2 as _kv_control_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "reservation_id", "prompt_token_ids", "output_token_ids", "sampling", "priority", "kv_wait_s", "local_prefill", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    kv_wait_s: float
    local_prefill: bool
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., kv_wait_s: _Optional[float] = ..., local_prefill: bool = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ...) -> None: ...

class DecodeStreamItem(_message.Message):
    __slots__ = ("decode", "abort", "metadata", "timeout_s")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    decode: DecodeRequest
    abort: _common_pb2.AbortRequest
    metadata: _containers.ScalarMap[str, str]
    timeout_s: float
    def __init__(self, decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., abort: _Optional[_Union[_common_pb2.AbortRequest, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...
