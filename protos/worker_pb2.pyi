from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ...) -> None: ...

class GenerateStreamItem(_message.Message):
    __slots__ = ("generate", "abort", "metadata", "timeout_s")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    abort: _common_pb2.AbortRequest
    metadata: _containers.ScalarMap[str, str]
    timeout_s: float
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[_common_pb2.AbortRequest, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "normalize", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    normalize: bool
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., normalize: bool = ..., priority: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "num_prompt_tokens", "num_cached_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    num_prompt_tokens: int
    num_cached_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...
