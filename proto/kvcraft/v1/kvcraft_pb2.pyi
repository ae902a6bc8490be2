from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT32: DType

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class VariantStats(_message.Message):
    __slots__ = ("a", "b", "prefix_attention", "token_inter_attention", "recompute_scores")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INTER_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SCORES_FIELD_NUMBER: _ClassVar[int]
    a: float
    b: float
    prefix_attention: _containers.RepeatedScalarFieldContainer[float]
    token_inter_attention: _containers.RepeatedScalarFieldContainer[float]
    recompute_scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, a: _Optional[float] = ..., b: _Optional[float] = ..., prefix_attention: _Optional[_Iterable[float]] = ..., token_inter_attention: _Optional[_Iterable[float]] = ..., recompute_scores: _Optional[_Iterable[float]] = ...) -> None: ...

class VariantInfo(_message.Message):
    __slots__ = ("variant_id", "chunk_key", "model_id", "prefix_keys", "token_count", "num_layers", "key_spec", "value_spec", "stats", "tier", "size_bytes", "fr", "last_access_unix_ms", "created_unix_ms", "pinned", "leased", "layer_checksums")
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KEY_SPEC_FIELD_NUMBER: _ClassVar[int]
    VALUE_SPEC_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FR_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    variant_id: str
    chunk_key: str
    model_id: str
    prefix_keys: _containers.RepeatedScalarFieldContainer[str]
    token_count: int
    num_layers: int
    key_spec: TensorSpec
    value_spec: TensorSpec
    stats: VariantStats
    tier: str
    size_bytes: int
    fr: float
    last_access_unix_ms: int
    created_unix_ms: int
    pinned: bool
    leased: bool
    layer_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, variant_id: _Optional[str] = ..., chunk_key: _Optional[str] = ..., model_id: _Optional[str] = ..., prefix_keys: _Optional[_Iterable[str]] = ..., token_count: _Optional[int] = ..., num_layers: _Optional[int] = ..., key_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., value_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., stats: _Optional[_Union[VariantStats, _Mapping]] = ..., tier: _Optional[str] = ..., size_bytes: _Optional[int] = ..., fr: _Optional[float] = ..., last_access_unix_ms: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., pinned: _Optional[bool] = ..., leased: _Optional[bool] = ..., layer_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanChunk(_message.Message):
    __slots__ = ("chunk_key", "token_count", "token_ids")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    token_count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunk_key: _Optional[str] = ..., token_count: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FidelitySample(_message.Message):
    __slots__ = ("policy", "top1_agree", "kl", "computed_share", "budget", "answer_tokens", "answer_agree", "shadow_blend", "lead")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREE_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_AGREE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_BLEND_FIELD_NUMBER: _ClassVar[int]
    LEAD_FIELD_NUMBER: _ClassVar[int]
    policy: str
    top1_agree: bool
    kl: float
    computed_share: float
    budget: float
    answer_tokens: int
    answer_agree: int
    shadow_blend: bool
    lead: float
    def __init__(self, policy: _Optional[str] = ..., top1_agree: _Optional[bool] = ..., kl: _Optional[float] = ..., computed_share: _Optional[float] = ..., budget: _Optional[float] = ..., answer_tokens: _Optional[int] = ..., answer_agree: _Optional[int] = ..., shadow_blend: _Optional[bool] = ..., lead: _Optional[float] = ...) -> None: ...

class TimingReport(_message.Message):
    __slots__ = ("loads", "computes", "fidelity")
    class Load(_message.Message):
        __slots__ = ("tier", "bytes_per_layer", "seconds")
        TIER_FIELD_NUMBER: _ClassVar[int]
        BYTES_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
        SECONDS_FIELD_NUMBER: _ClassVar[int]
        tier: str
        bytes_per_layer: float
        seconds: float
        def __init__(self, tier: _Optional[str] = ..., bytes_per_layer: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...
    class Compute(_message.Message):
        __slots__ = ("tokens_per_layer", "seconds")
        TOKENS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
        SECONDS_FIELD_NUMBER: _ClassVar[int]
        tokens_per_layer: float
        seconds: float
        def __init__(self, tokens_per_layer: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...
    LOADS_FIELD_NUMBER: _ClassVar[int]
    COMPUTES_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[TimingReport.Load]
    computes: _containers.RepeatedCompositeFieldContainer[TimingReport.Compute]
    fidelity: _containers.RepeatedCompositeFieldContainer[FidelitySample]
    def __init__(self, loads: _Optional[_Iterable[_Union[TimingReport.Load, _Mapping]]] = ..., computes: _Optional[_Iterable[_Union[TimingReport.Compute, _Mapping]]] = ..., fidelity: _Optional[_Iterable[_Union[FidelitySample, _Mapping]]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("model_id", "conversation_id", "chunks", "question_tokens", "lease_ttl_s", "timings", "first_turn", "policy", "adaptive")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    QUESTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TURN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    conversation_id: str
    chunks: _containers.RepeatedCompositeFieldContainer[PlanChunk]
    question_tokens: int
    lease_ttl_s: float
    timings: TimingReport
    first_turn: bool
    policy: str
    adaptive: bool
    def __init__(self, model_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[PlanChunk, _Mapping]]] = ..., question_tokens: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., timings: _Optional[_Union[TimingReport, _Mapping]] = ..., first_turn: _Optional[bool] = ..., policy: _Optional[str] = ..., adaptive: _Optional[bool] = ...) -> None: ...

class KeyChain(_message.Message):
    __slots__ = ("ranges",)
    RANGES_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class ChunkPlan(_message.Message):
    __slots__ = ("chunk_key", "position", "token_start", "token_count", "source", "variant_id", "tier", "cfo", "recompute", "variant_prefix_chain", "variant_prefix_length")
    class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SOURCE_UNSPECIFIED: _ClassVar[ChunkPlan.Source]
        FRESH: _ClassVar[ChunkPlan.Source]
        PREFIX: _ClassVar[ChunkPlan.Source]
        VARIANT: _ClassVar[ChunkPlan.Source]
    SOURCE_UNSPECIFIED: ChunkPlan.Source
    FRESH: ChunkPlan.Source
    PREFIX: ChunkPlan.Source
    VARIANT: ChunkPlan.Source
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CFO_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    VARIANT_PREFIX_CHAIN_FIELD_NUMBER: _ClassVar[int]
    VARIANT_PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    position: int
    token_start: int
    token_count: int
    source: ChunkPlan.Source
    variant_id: str
    tier: str
    cfo: float
    recompute: _containers.RepeatedScalarFieldContainer[int]
    variant_prefix_chain: int
    variant_prefix_length: int
    def __init__(self, chunk_key: _Optional[str] = ..., position: _Optional[int] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., source: _Optional[_Union[ChunkPlan.Source, str]] = ..., variant_id: _Optional[str] = ..., tier: _Optional[str] = ..., cfo: _Optional[float] = ..., recompute: _Optional[_Iterable[int]] = ..., variant_prefix_chain: _Optional[int] = ..., variant_prefix_length: _Optional[int] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("order", "dropped", "chunks", "history", "ratio", "preload_depth", "load_s_per_layer", "compute_s_per_layer", "lease_id", "lease_expires_unix_ms", "computed_tokens", "other_keys", "variant_prefixes", "recompute_budget", "fidelity_sample", "fidelity_below", "no_reuse", "near_tie")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    PRELOAD_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OTHER_KEYS_FIELD_NUMBER: _ClassVar[int]
    VARIANT_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_BELOW_FIELD_NUMBER: _ClassVar[int]
    NO_REUSE_FIELD_NUMBER: _ClassVar[int]
    NEAR_TIE_FIELD_NUMBER: _ClassVar[int]
    order: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkPlan]
    history: _containers.RepeatedScalarFieldContainer[str]
    ratio: float
    preload_depth: int
    load_s_per_layer: float
    compute_s_per_layer: float
    lease_id: str
    lease_expires_unix_ms: int
    computed_tokens: int
    other_keys: _containers.RepeatedScalarFieldContainer[str]
    variant_prefixes: _containers.RepeatedCompositeFieldContainer[KeyChain]
    recompute_budget: float
    fidelity_sample: bool
    fidelity_below: float
    no_reuse: bool
    near_tie: float
    def __init__(self, order: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[str]] = ..., chunks: _Optional[_Iterable[_Union[ChunkPlan, _Mapping]]] = ..., history: _Optional[_Iterable[str]] = ..., ratio: _Optional[float] = ..., preload_depth: _Optional[int] = ..., load_s_per_layer: _Optional[float] = ..., compute_s_per_layer: _Optional[float] = ..., lease_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., other_keys: _Optional[_Iterable[str]] = ..., variant_prefixes: _Optional[_Iterable[_Union[KeyChain, _Mapping]]] = ..., recompute_budget: _Optional[float] = ..., fidelity_sample: _Optional[bool] = ..., fidelity_below: _Optional[float] = ..., no_reuse: _Optional[bool] = ..., near_tie: _Optional[float] = ...) -> None: ...

class StoreHeader(_message.Message):
    __slots__ = ("model_id", "token_ids", "prefix_keys", "num_layers", "key_spec", "value_spec", "stats")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KEY_SPEC_FIELD_NUMBER: _ClassVar[int]
    VALUE_SPEC_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_keys: _containers.RepeatedScalarFieldContainer[str]
    num_layers: int
    key_spec: TensorSpec
    value_spec: TensorSpec
    stats: VariantStats
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prefix_keys: _Optional[_Iterable[str]] = ..., num_layers: _Optional[int] = ..., key_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., value_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., stats: _Optional[_Union[VariantStats, _Mapping]] = ...) -> None: ...

class LayerPayload(_message.Message):
    __slots__ = ("layer", "key", "value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    key: bytes
    value: bytes
    def __init__(self, layer: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("header", "layer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    layer: LayerPayload
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., layer: _Optional[_Union[LayerPayload, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("chunk_key", "variant_id", "bytes_stored", "already_present")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    variant_id: str
    bytes_stored: int
    already_present: bool
    def __init__(self, chunk_key: _Optional[str] = ..., variant_id: _Optional[str] = ..., bytes_stored: _Optional[int] = ..., already_present: _Optional[bool] = ...) -> None: ...

class StoreLocalRequest(_message.Message):
    __slots__ = ("start", "staged")
    START_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    start: StoreLocalStart
    staged: StagedLayers
    def __init__(self, start: _Optional[_Union[StoreLocalStart, _Mapping]] = ..., staged: _Optional[_Union[StagedLayers, _Mapping]] = ...) -> None: ...

class StoreLocalStart(_message.Message):
    __slots__ = ("header", "staging")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    staging: StagingArea
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., staging: _Optional[_Union[StagingArea, _Mapping]] = ...) -> None: ...

class StagingArea(_message.Message):
    __slots__ = ("staging_id", "pid", "fd")
    STAGING_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    staging_id: str
    pid: int
    fd: int
    def __init__(self, staging_id: _Optional[str] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ...) -> None: ...

class StagedLayers(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    def __init__(self, layers: _Optional[int] = ...) -> None: ...

class StoreLocalResponse(_message.Message):
    __slots__ = ("accepted", "result")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    accepted: StagingAccepted
    result: StoreResponse
    def __init__(self, accepted: _Optional[_Union[StagingAccepted, _Mapping]] = ..., result: _Optional[_Union[StoreResponse, _Mapping]] = ...) -> None: ...

class StagingAccepted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VariantRef(_message.Message):
    __slots__ = ("chunk_key", "variant_id", "cfo")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    CFO_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    variant_id: str
    cfo: float
    def __init__(self, chunk_key: _Optional[str] = ..., variant_id: _Optional[str] = ..., cfo: _Optional[float] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("variants", "first_layer", "num_layers")
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    variants: _containers.RepeatedCompositeFieldContainer[VariantRef]
    first_layer: int
    num_layers: int
    def __init__(self, variants: _Optional[_Iterable[_Union[VariantRef, _Mapping]]] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class LayerChunk(_message.Message):
    __slots__ = ("layer", "index", "variant_id", "key_spec", "value_spec", "key", "value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_SPEC_FIELD_NUMBER: _ClassVar[int]
    VALUE_SPEC_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    index: int
    variant_id: str
    key_spec: TensorSpec
    value_spec: TensorSpec
    key: bytes
    value: bytes
    def __init__(self, layer: _Optional[int] = ..., index: _Optional[int] = ..., variant_id: _Optional[str] = ..., key_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., value_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("chunk_key", "tokens")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    tokens: ChunkTokens
    def __init__(self, chunk_key: _Optional[str] = ..., tokens: _Optional[_Union[ChunkTokens, _Mapping]] = ...) -> None: ...

class ChunkTokens(_message.Message):
    __slots__ = ("model_id", "token_ids")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found", "chunk_key", "variants")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    chunk_key: str
    variants: _containers.RepeatedCompositeFieldContainer[VariantInfo]
    def __init__(self, found: _Optional[bool] = ..., chunk_key: _Optional[str] = ..., variants: _Optional[_Iterable[_Union[VariantInfo, _Mapping]]] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("variant_ids",)
    VARIANT_IDS_FIELD_NUMBER: _ClassVar[int]
    variant_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, variant_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("matched",)
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    matched: int
    def __init__(self, matched: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("variants", "ttl_s")
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    variants: _containers.RepeatedCompositeFieldContainer[VariantRef]
    ttl_s: float
    def __init__(self, variants: _Optional[_Iterable[_Union[VariantRef, _Mapping]]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("lease_id", "variant_ids", "expires_unix_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    VARIANT_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    variant_ids: _containers.RepeatedScalarFieldContainer[str]
    expires_unix_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., variant_ids: _Optional[_Iterable[str]] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("variants", "lease_ttl_s")
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    variants: _containers.RepeatedCompositeFieldContainer[VariantRef]
    lease_ttl_s: float
    def __init__(self, variants: _Optional[_Iterable[_Union[VariantRef, _Mapping]]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class VariantLocation(_message.Message):
    __slots__ = ("variant_id", "offset", "length", "num_layers", "key_spec", "value_spec", "gpu_offset", "gpu_length")
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KEY_SPEC_FIELD_NUMBER: _ClassVar[int]
    VALUE_SPEC_FIELD_NUMBER: _ClassVar[int]
    GPU_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GPU_LENGTH_FIELD_NUMBER: _ClassVar[int]
    variant_id: str
    offset: int
    length: int
    num_layers: int
    key_spec: TensorSpec
    value_spec: TensorSpec
    gpu_offset: int
    gpu_length: int
    def __init__(self, variant_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., num_layers: _Optional[int] = ..., key_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., value_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., gpu_offset: _Optional[int] = ..., gpu_length: _Optional[int] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("segment", "variants", "lease_id", "lease_expires_unix_ms", "gpu_ipc_handle", "gpu_pool_bytes", "gpu_device", "instance_id")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GPU_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_DEVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    segment: str
    variants: _containers.RepeatedCompositeFieldContainer[VariantLocation]
    lease_id: str
    lease_expires_unix_ms: int
    gpu_ipc_handle: bytes
    gpu_pool_bytes: int
    gpu_device: int
    instance_id: str
    def __init__(self, segment: _Optional[str] = ..., variants: _Optional[_Iterable[_Union[VariantLocation, _Mapping]]] = ..., lease_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., gpu_ipc_handle: _Optional[bytes] = ..., gpu_pool_bytes: _Optional[int] = ..., gpu_device: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class PlanStreamResponse(_message.Message):
    __slots__ = ("plan", "error")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    plan: PlanResponse
    error: CallError
    def __init__(self, plan: _Optional[_Union[PlanResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "bytes_used", "bytes_budget", "variants", "hits", "misses")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes_used: int
    bytes_budget: int
    variants: int
    hits: int
    misses: int
    def __init__(self, name: _Optional[str] = ..., bytes_used: _Optional[int] = ..., bytes_budget: _Optional[int] = ..., variants: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ...) -> None: ...

class FidelityStats(_message.Message):
    __slots__ = ("model_id", "policy", "samples", "top1_agree", "agree_lower", "agree_upper", "mean_kl", "mean_computed_share", "budget", "answer_tokens", "answer_agree", "shadow_blends")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREE_FIELD_NUMBER: _ClassVar[int]
    AGREE_LOWER_FIELD_NUMBER: _ClassVar[int]
    AGREE_UPPER_FIELD_NUMBER: _ClassVar[int]
    MEAN_KL_FIELD_NUMBER: _ClassVar[int]
    MEAN_COMPUTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_AGREE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_BLENDS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    policy: str
    samples: int
    top1_agree: int
    agree_lower: float
    agree_upper: float
    mean_kl: float
    mean_computed_share: float
    budget: float
    answer_tokens: int
    answer_agree: int
    shadow_blends: int
    def __init__(self, model_id: _Optional[str] = ..., policy: _Optional[str] = ..., samples: _Optional[int] = ..., top1_agree: _Optional[int] = ..., agree_lower: _Optional[float] = ..., agree_upper: _Optional[float] = ..., mean_kl: _Optional[float] = ..., mean_computed_share: _Optional[float] = ..., budget: _Optional[float] = ..., answer_tokens: _Optional[int] = ..., answer_agree: _Optional[int] = ..., shadow_blends: _Optional[int] = ...) -> None: ...

class FidelityBudget(_message.Message):
    __slots__ = ("model_id", "policy", "budget", "state", "below", "near_tie")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BELOW_FIELD_NUMBER: _ClassVar[int]
    NEAR_TIE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    policy: str
    budget: float
    state: str
    below: float
    near_tie: float
    def __init__(self, model_id: _Optional[str] = ..., policy: _Optional[str] = ..., budget: _Optional[float] = ..., state: _Optional[str] = ..., below: _Optional[float] = ..., near_tie: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("chunks", "variants", "tiers", "evictions", "moves", "leases", "pinned", "inflight_store_bytes", "inflight_stores", "fidelity", "budgets", "fidelity_target", "cluster")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_STORES_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_TARGET_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    variants: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    evictions: int
    moves: int
    leases: int
    pinned: int
    inflight_store_bytes: int
    inflight_stores: int
    fidelity: _containers.RepeatedCompositeFieldContainer[FidelityStats]
    budgets: _containers.RepeatedCompositeFieldContainer[FidelityBudget]
    fidelity_target: float
    cluster: ClusterStats
    def __init__(self, chunks: _Optional[int] = ..., variants: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., evictions: _Optional[int] = ..., moves: _Optional[int] = ..., leases: _Optional[int] = ..., pinned: _Optional[int] = ..., inflight_store_bytes: _Optional[int] = ..., inflight_stores: _Optional[int] = ..., fidelity: _Optional[_Iterable[_Union[FidelityStats, _Mapping]]] = ..., budgets: _Optional[_Iterable[_Union[FidelityBudget, _Mapping]]] = ..., fidelity_target: _Optional[float] = ..., cluster: _Optional[_Union[ClusterStats, _Mapping]] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("master_up", "silent_segments")
    MASTER_UP_FIELD_NUMBER: _ClassVar[int]
    SILENT_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    master_up: bool
    silent_segments: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, master_up: _Optional[bool] = ..., silent_segments: _Optional[_Iterable[str]] = ...) -> None: ...

class ListChunksRequest(_message.Message):
    __slots__ = ("model_id", "page_size", "page_token")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    page_size: int
    page_token: str
    def __init__(self, model_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ChunkSummary(_message.Message):
    __slots__ = ("chunk_key", "model_id", "token_count", "variants", "size_bytes")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    model_id: str
    token_count: int
    variants: int
    size_bytes: int
    def __init__(self, chunk_key: _Optional[str] = ..., model_id: _Optional[str] = ..., token_count: _Optional[int] = ..., variants: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ListChunksResponse(_message.Message):
    __slots__ = ("chunks", "next_page_token")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkSummary]
    next_page_token: str
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetChunkRequest(_message.Message):
    __slots__ = ("chunk_key",)
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    def __init__(self, chunk_key: _Optional[str] = ...) -> None: ...

class GetChunkResponse(_message.Message):
    __slots__ = ("variants",)
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    variants: _containers.RepeatedCompositeFieldContainer[VariantInfo]
    def __init__(self, variants: _Optional[_Iterable[_Union[VariantInfo, _Mapping]]] = ...) -> None: ...

class VariantSelector(_message.Message):
    __slots__ = ("chunk_key", "variant_id")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    variant_id: str
    def __init__(self, chunk_key: _Optional[str] = ..., variant_id: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "skipped_protected")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PROTECTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    skipped_protected: int
    def __init__(self, evicted: _Optional[int] = ..., skipped_protected: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("variants",)
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    variants: int
    def __init__(self, variants: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("evicted", "skipped_protected")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PROTECTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    skipped_protected: int
    def __init__(self, evicted: _Optional[int] = ..., skipped_protected: _Optional[int] = ...) -> None: ...

class ConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigResponse(_message.Message):
    __slots__ = ("toml",)
    TOML_FIELD_NUMBER: _ClassVar[int]
    toml: str
    def __init__(self, toml: _Optional[str] = ...) -> None: ...
