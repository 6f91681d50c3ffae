from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "ttl_s", "wait_s", "priority", "owner", "grant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    ttl_s: float
    wait_s: float
    priority: int
    owner: str
    grant: bool
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., ttl_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., priority: _Optional[int] = ..., owner: _Optional[str] = ..., grant: bool = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "num_blocks", "kv_endpoint", "decode_worker_id", "kv_grant")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_GRANT_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_blocks: int
    kv_endpoint: str
    decode_worker_id: str
    kv_grant: str
    def __init__(self, reservation_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., kv_grant: _Optional[str] = ...) -> None: ...

class KvTarget(_message.Message):
    __slots__ = ("kv_endpoint", "reservation_id", "decode_worker_id", "kv_grant")
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_GRANT_FIELD_NUMBER: _ClassVar[int]
    kv_endpoint: str
    reservation_id: str
    decode_worker_id: str
    kv_grant: str
    def __init__(self, kv_endpoint: _Optional[str] = ..., reservation_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., kv_grant: _Optional[str] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("bytes", "seconds", "num_blocks")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    num_blocks: int
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., num_blocks: _Optional[int] = ...) -> None: ...
