"""What a recipe declares (spec section 9), as frozen dataclasses, and the memory cost model.

Importable without torch: `ignition --help` reads these declarations. Every number a recipe states
about a checkpoint (revision, stored bytes, sampling defaults) was looked up, never guessed; where it
could not be confirmed the field is None and the recipe says so.

The memory cost model is a set of plain functions of a checkpoint's config.json dict, so the same
estimate serves a declared alias (its `Checkpoint.config` excerpt), a hub repository (config.json
read from the hub) and a local directory.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from flare.models.quantization import KV_SCALE_BYTES, fp8_weights_of
from flare.recipes import deepseek_costs
from flare.models.quantization import online_fp8 as online_fp8_weights

BF16_BYTES = 2
FLOAT32_BYTES = 4
INT32_BYTES = 4
MIB = 1024 ** 2


@dataclass(frozen=True)
class Checkpoint:
    """One qualified checkpoint a recipe declares.

    source: "hub" (repo_id at a pinned revision) or "builtin" (built locally by `flare.demo`).
    revision: a 40-hex commit, or None when it could not be pinned (the hub's current commit is used
        and reported).
    stored_bytes: bytes of tensor data in the checkpoint's safetensors files (all on the device for
        these dense families), so the estimate needs no cached snapshot. None when unknown.
    decode_weight_bytes: bytes of weights one decode step reads for one request across every rank.
    config: the geometry excerpt of the checkpoint's config.json, under config.json's own key names,
        so the memory cost model can run before anything is downloaded.
    """

    alias: str
    architecture: str
    served_name: str
    source: str = "hub"
    repo_id: str | None = None
    revision: str | None = None
    stored_bytes: int | None = None
    decode_weight_bytes: int | None = None
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    export_repository: str | None = None
    stored_bytes_note: str = ""             # why stored_bytes is undeclared for a pinned revision

    def __post_init__(self):
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))

    @property
    def context_length(self) -> int | None:
        return self.config.get("max_position_embeddings")


def hub_checkpoint(architecture: str, organization: str, alias: str, served_name: str, revision: str | None,
                   stored_bytes: int | None, config: Mapping[str, Any]) -> Checkpoint:
    """A checkpoint published as `organization/served_name`, its decode weight bytes computed from `config`.
    Recipes bind the first two (`functools.partial`) and list their checkpoints with the rest."""
    return Checkpoint(alias=alias, architecture=architecture, served_name=served_name,
                      repo_id=f"{organization}/{served_name}", revision=revision, stored_bytes=stored_bytes,
                      decode_weight_bytes=decode_weight_bytes(config), config=config)


@dataclass(frozen=True)
class ConcurrencyRange:
    minimum: int
    default: int
    maximum: int


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as the recipe supports it for a checkpoint; `available` False means decode one
    token a step. `history`: drafts can be copied from each request's decoded history (`flare run
    --history-drafts`). `token_capacity`: the default speculative token capacity (most target rows of a
    verification step, `--speculative-token-capacity`)."""

    available: bool
    default_draft_tokens: int
    max_draft_tokens: int
    note: str = ""
    history: bool = False
    token_capacity: int = 128
    # A learned draft: a small checkpoint of the same tokenizer, fetched into the hub cache at export
    # (unless the target checkpoint supplies one in draft/; --no-mtp fetches nothing).
    draft: Checkpoint | None = None
    # The checkpoint's own multi-token-prediction layers draft (DeepSeek's num_nextn_predict_layers,
    # flare.models.deepseek_mtp), where its files carry them; --no-mtp leaves them out of the package.
    mtp: bool = False


def draft_speculation(draft: Checkpoint, name: str) -> Speculation:
    """Speculation with `draft` (named `name` for people) as the learned draft, history drafts beside it."""
    return Speculation(available=True, default_draft_tokens=4, max_draft_tokens=8, history=True, draft=draft,
                       note=f"{name} drafts (it shares the tokenizer); history drafts with flare run --history-drafts")


# Every dense family here verifies drafts copied from a request's history; without a learned draft they are
# all it has. Four drafts by default (an answer that repeats its prompt keeps most of them), at most eight.
HISTORY_SPECULATION = Speculation(available=True, default_draft_tokens=4, max_draft_tokens=8, history=True,
                                  note="drafts copied from decoded history (flare run --history-drafts); "
                                       "no learned draft for this checkpoint")


@dataclass(frozen=True)
class SamplingDefaults:
    """The values a request receives for fields it does not set, and the inclusive ranges it may choose from.

    A parameter without a range is fixed at its default (spec section 3.3). `source` says where the
    defaults were verified (model card or generation_config.json at the pinned revision).
    """

    temperature: float
    top_p: float
    top_k: int               # 0 disables top-k
    min_p: float
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict, compare=False)
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "ranges", MappingProxyType(dict(self.ranges)))

    def defaults(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")

# The bounds the OpenAI API itself accepts; a recipe narrows them where its model card does.
API_SAMPLING_RANGES: Mapping[str, tuple[float, float]] = MappingProxyType({
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 1_000_000),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (1.0, 2.0),
})


def sampling_ranges(**narrowed: tuple[float, float]) -> dict[str, tuple[float, float]]:
    """The API's bounds with the model card's narrower ranges applied."""
    ranges = dict(API_SAMPLING_RANGES)
    ranges.update(narrowed)
    return ranges


# Decode graphs are captured at these batch sizes: powers of two up to 8, then steps that keep the
# padding of a partly filled batch at or below 25% while the catalog stays under twenty graphs.
DECODE_CAPACITIES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def decode_capacities_for(capacities: Sequence[int], max_concurrency: int) -> tuple[int, ...]:
    """The graph batch sizes for `max_concurrency` requests (spec section 4, "Decode graph capacities"):
    1 through max_concurrency, rounded up to the captured set `capacities`, so concurrency three takes the
    batch-four bucket. The one definition: the recipe's help, the plan an export records, the engine
    configuration and the graphs captured all come from it.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    ordered = tuple(sorted(set(capacities)))
    last = bisect.bisect_left(ordered, max_concurrency)
    if last == len(ordered):
        raise ValueError(f"no captured batch size holds {max_concurrency} requests; the largest is "
                         f"{ordered[-1] if ordered else 'none'}")
    return ordered[: last + 1]


@dataclass(frozen=True)
class Recipe:
    """Everything the command line does not need to know about a model family (spec section 9)."""

    family: str
    title: str
    architectures: tuple[str, ...]
    checkpoints: tuple[Checkpoint, ...]
    tensor_parallel_sizes: tuple[int, ...]
    concurrency: ConcurrencyRange
    page_size: int
    prefill_chunk: int
    decode_capacities: tuple[int, ...]
    speculation: Speculation
    sampling: SamplingDefaults
    image_support: bool = False
    reasoning_parser: str | None = None      # how the family's reasoning block is read (frontend/reasoning.py)
    version: int = 1
    # Decoder projections `ignition export --online-mxfp8` may store as FP8 (checkpoint names: q_proj,
    # ...); a recipe naming none rejects the flag.
    online_fp8_projections: tuple[str, ...] = ()
    sampling_by_alias: Mapping[str, SamplingDefaults] = field(default_factory=dict, compare=False)
    speculation_by_alias: Mapping[str, Speculation] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "sampling_by_alias", MappingProxyType(dict(self.sampling_by_alias)))
        object.__setattr__(self, "speculation_by_alias", MappingProxyType(dict(self.speculation_by_alias)))

    def speculation_for(self, checkpoint: Checkpoint | None) -> Speculation:
        """Speculation for a checkpoint; one with a learned draft declares its own."""
        if checkpoint is not None and checkpoint.alias in self.speculation_by_alias:
            return self.speculation_by_alias[checkpoint.alias]
        return self.speculation

    def sampling_for(self, checkpoint: Checkpoint | None) -> SamplingDefaults:
        """Sampling defaults for a checkpoint; a checkpoint whose card differs from the family's has its own."""
        if checkpoint is not None and checkpoint.alias in self.sampling_by_alias:
            return self.sampling_by_alias[checkpoint.alias]
        return self.sampling

    def tensor_parallel_sizes_for(self, hf_config: Mapping[str, Any]) -> tuple[int, ...]:
        """The declared sizes that split this checkpoint's attention and KV heads evenly."""
        heads = hf_config.get("num_attention_heads")
        kv_heads = hf_config.get("num_key_value_heads", heads)
        if not heads:
            return self.tensor_parallel_sizes
        return tuple(size for size in self.tensor_parallel_sizes
                     if heads % size == 0 and kv_heads % size == 0)

    def decode_capacities_for(self, max_concurrency: int) -> tuple[int, ...]:
        """Captured batch sizes up to the first one that holds `max_concurrency` requests."""
        return decode_capacities_for(self.decode_capacities, max_concurrency)

    def cache_help(self, checkpoint: Checkpoint) -> list[tuple[str, str]]:
        """`MODEL --help`'s rows on the KV cache (a family with another cache states its own)."""
        config = checkpoint.config
        return [("KV cache", f"{kv_bytes_per_token(config) / 1024:,.0f} KiB per cached token (bfloat16, one GPU); "
                             f"{kv_bytes_per_token(config, kv_cache_dtype='fp8') / 1024:,.0f} KiB with --kv-cache-dtype fp8")]

    # The recipe's memory cost model (spec section 9); every family here is a dense decoder, so all
    # share the functions below. A family with other state (sliding windows, MTP heads) overrides these.

    def kv_bytes_per_token(self, hf_config: Mapping[str, Any], tensor_parallel: int = 1) -> int:
        return kv_bytes_per_token(hf_config, tensor_parallel=tensor_parallel)

    def snapshot_bytes(self, hf_config: Mapping[str, Any]) -> int:
        return snapshot_bytes(hf_config)

    def live_state_bytes_per_request(self, hf_config: Mapping[str, Any], context_length: int | None = None) -> int:
        return live_state_bytes_per_request(hf_config, self.page_size, context_length)

    def graph_and_scratch_bytes(self, hf_config: Mapping[str, Any], max_concurrency: int,
                                prefill_chunk: int | None = None, tensor_parallel: int = 1,
                                online_fp8: tuple[str, ...] = ()) -> int:
        return graph_and_scratch_bytes(hf_config, max_concurrency, prefill_chunk or self.prefill_chunk,
                                       tensor_parallel, online_fp8)


# ---------------------------------------------------------------------------------------------------
# Memory cost model: plain functions of a config.json dict (dense decoder-only transformers).


def head_dim(hf_config: Mapping[str, Any]) -> int:
    explicit = hf_config.get("head_dim")
    return int(explicit) if explicit else hf_config["hidden_size"] // hf_config["num_attention_heads"]


def kv_heads(hf_config: Mapping[str, Any]) -> int:
    return int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])


def _v4():
    """The DeepSeek V4 cost model, for configs it owns (flare.recipes.deepseek_v4.is_deepseek_v4)."""
    from flare.recipes import deepseek_v4

    return deepseek_v4


def kv_bytes_per_token(hf_config: Mapping[str, Any], dtype_bytes: int = BF16_BYTES,
                       tensor_parallel: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Bytes one cached token occupies on one rank: K and V for every layer. `kv_cache_dtype` "fp8": one
    byte per element and a float32 scale per KV head (flare.models.quantization), else `dtype_bytes`. A
    latent-attention (MLA) config caches one latent row per layer instead, on every rank. DeepSeek V4: its
    "tokens" pages per token (flare.models.cache_spec), whole on every rank."""
    if _v4().is_deepseek_v4(hf_config):
        return _v4().kv_bytes_per_token(hf_config, dtype_bytes)
    if deepseek_costs.is_mla(hf_config):
        return deepseek_costs.latent_bytes_per_token(hf_config, dtype_bytes, kv_cache_dtype)
    per_rank_kv_heads = max(1, kv_heads(hf_config) // tensor_parallel)
    if kv_cache_dtype == "fp8":
        per_head = head_dim(hf_config) + KV_SCALE_BYTES
    else:
        per_head = head_dim(hf_config) * dtype_bytes
    return 2 * hf_config["num_hidden_layers"] * per_rank_kv_heads * per_head


def kv_replicated(hf_config: Mapping[str, Any]) -> bool:
    """Whether every tensor-parallel rank holds the whole KV cache: a cache row that every query head reads
    (DeepSeek V4's one KV head, MLA's latent row) is not divided between ranks."""
    return _v4().is_deepseek_v4(hf_config) or deepseek_costs.is_mla(hf_config)


def window_pool(hf_config: Mapping[str, Any], page_size: int, prompt_tokens: int,
                dtype_bytes: int = BF16_BYTES):
    """The window pages a model's cache keeps beside its KV pages (`flare.memory.WindowPool`; none for a
    cache without a window kind): DeepSeek V4's sliding keys and compressor inputs."""
    from flare.memory import WindowPool

    if not _v4().is_deepseek_v4(hf_config):
        return WindowPool()
    return _v4().cache_spec_of(hf_config, dtype_bytes, page_size).window_pool(prompt_tokens)


def snapshot_bytes(hf_config: Mapping[str, Any]) -> int:
    """Extra bytes a prefix-cache snapshot needs beyond its KV pages: none, snapshots borrow pages."""
    return 0


def live_state_bytes_per_request(hf_config: Mapping[str, Any], page_size: int,
                                 context_length: int | None = None) -> int:
    """Bytes held per active request slot outside the KV pages.

    The float32 logits row and the int32 token counts that presence/frequency penalties need (one
    vocabulary-sized row each), the block-table row for a full context, and a few hidden-size rows of
    decode activations kept in the captured graphs' static buffers.
    """
    vocab = hf_config["vocab_size"]
    context = context_length or hf_config.get("max_position_embeddings", 8192)
    pages = -(-context // page_size)
    activations = 8 * hf_config["hidden_size"] * BF16_BYTES
    return vocab * FLOAT32_BYTES + vocab * INT32_BYTES + pages * INT32_BYTES + activations


def activation_bytes_per_token(hf_config: Mapping[str, Any], tensor_parallel: int = 1) -> int:
    """Peak bf16 activation bytes one token needs inside a layer: residual, q/k/v, attention out, MLP."""
    if _v4().is_deepseek_v4(hf_config):
        return _v4().activation_bytes_per_token(hf_config, tensor_parallel)
    if deepseek_costs.is_mla(hf_config):
        return deepseek_costs.activation_bytes_per_token(hf_config, BF16_BYTES, tensor_parallel)
    hidden = hf_config["hidden_size"]
    q_width = hf_config["num_attention_heads"] * head_dim(hf_config) // tensor_parallel
    kv_width = kv_heads(hf_config) * head_dim(hf_config) // max(1, tensor_parallel)
    mlp = 2 * hf_config["intermediate_size"] // tensor_parallel        # gate and up, fused
    return (3 * hidden + 2 * q_width + 2 * kv_width + mlp) * BF16_BYTES


def graph_and_scratch_bytes(hf_config: Mapping[str, Any], max_concurrency: int, prefill_chunk: int,
                            tensor_parallel: int = 1, online_fp8: tuple[str, ...] = ()) -> int:
    """A cold host's estimate of compiled-graph pools and scratch on one rank.

    A fixed 512 MiB for the CUDA context, cuBLAS/Triton workspaces and compiled kernels; activations
    for one prefill chunk and for the largest decode batch; float32 logits for the decode batch; for FP8
    projections (config.json's, or `online_fp8`'s), the buffer their weights are dequantized into.
    """
    fixed = 512 * MIB
    tokens = prefill_chunk + max_concurrency
    logits = max_concurrency * hf_config["vocab_size"] * FLOAT32_BYTES
    indexer = (_v4().indexer_scratch_bytes(hf_config, hf_config["max_position_embeddings"])
               if _v4().is_deepseek_v4(hf_config) else 0)
    return (fixed + tokens * activation_bytes_per_token(hf_config, tensor_parallel) + logits
            + fp8_scratch_bytes(hf_config, tensor_parallel, online_fp8) + indexer)


def fp8_scratch_bytes(hf_config: Mapping[str, Any], tensor_parallel: int = 1, online_fp8: tuple[str, ...] = (),
                      dtype_bytes: int = BF16_BYTES) -> int:
    """The one buffer prompt steps dequantize FP8 weights into before cuBLAS (flare.kernels.fp8_scratch):
    the largest FP8 layer's weight in the serving dtype (fused gate/up for llama-8b, 235 MB); 0 without
    FP8 projections."""
    fp8 = online_fp8_weights(online_fp8) if online_fp8 else fp8_weights_of(hf_config)
    if fp8 is None or deepseek_costs.is_mla(hf_config):   # MLA: kv_b_proj is dequantized; experts' own buffers
        return 0
    if _v4().is_deepseek_v4(hf_config):       # the largest FP8 projection: wq_b, wo_a or wo_b
        heads_width = hf_config["num_attention_heads"] * hf_config.get("head_dim", 512)
        return heads_width * max(hf_config.get("q_lora_rank", 1024), hf_config["hidden_size"]
                                 // hf_config.get("o_groups", 8)) * dtype_bytes // tensor_parallel
    shapes = projection_shapes(hf_config)
    largest = 0
    for fused in FUSED_PROJECTIONS:
        if any(fp8.quantizes(f"model.layers.0.{name}") for name in fused):
            rows = sum(shapes[name][0] for name in fused)
            largest = max(largest, rows * shapes[fused[0]][1])
    return largest * dtype_bytes // tensor_parallel


def parameter_count(hf_config: Mapping[str, Any], lm_head_stored: bool, active: bool = False) -> int:
    """Parameters a dense Llama/Qwen/Mistral checkpoint stores, from config.json's shapes (a DeepSeek
    one's: recipes.deepseek_costs; `active`: only the experts one token runs).

    `lm_head_stored` is a fact about the checkpoint file, not the architecture: some checkpoints
    with tied embeddings still store a copy of the output projection.
    """
    if deepseek_costs.is_mla(hf_config):
        return deepseek_costs.parameter_count(hf_config, lm_head_stored, active)
    hidden = hf_config["hidden_size"]
    dim = head_dim(hf_config)
    q_width = hf_config["num_attention_heads"] * dim
    kv_width = kv_heads(hf_config) * dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if hf_config.get("attention_bias") or hf_config.get("model_type") == "qwen2":
        attention += q_width + 2 * kv_width                         # q/k/v biases
    if hf_config.get("model_type") == "qwen3":
        attention += 2 * dim                                        # per-head q and k RMSNorm
    mlp = 3 * hidden * hf_config["intermediate_size"]
    layer = attention + mlp + 2 * hidden                            # two RMSNorms
    embedding = hf_config["vocab_size"] * hidden
    head = embedding if lm_head_stored else 0
    return embedding + hf_config["num_hidden_layers"] * layer + hidden + head


def decode_weight_bytes(hf_config: Mapping[str, Any], dtype_bytes: int = BF16_BYTES,
                        online_fp8: tuple[str, ...] = ()) -> int:
    """Weight bytes one decode step reads for one request: every matrix except the embedding table
    (one row per token), plus the output projection once, whether tied or stored separately. FP8
    projections (the checkpoint's, or `online_fp8`'s) count their e4m3 bytes and their scales as a
    package stores them (float32)."""
    # The embedding table's bytes stand in for the output projection's: the same vocab x hidden shape.
    return weight_bytes(hf_config, False, dtype_bytes, FLOAT32_BYTES, online_fp8, active=True)


def weight_bytes(hf_config: Mapping[str, Any], lm_head_stored: bool, dtype_bytes: int = BF16_BYTES,
                 scale_bytes: int = FLOAT32_BYTES, online_fp8: tuple[str, ...] = (), active: bool = False) -> int:
    """Bytes of a checkpoint's tensors: `dtype_bytes` per parameter, except FP8 projections (config.json's
    quantization_config, or the decoder projections `online_fp8` names), one byte per weight and
    `scale_bytes` per scale. `active`: of a mixture of experts, only the experts one token runs. A DeepSeek
    V4 checkpoint's tensors are counted in the formats it is published in (flare.recipes.deepseek_v4)."""
    if _v4().is_deepseek_v4(hf_config):
        return _v4().decode_weight_bytes(hf_config) if active else _v4().stored_bytes(hf_config)
    fp8 = online_fp8_weights(online_fp8) if online_fp8 else fp8_weights_of(hf_config)
    total = parameter_count(hf_config, lm_head_stored, active) * dtype_bytes
    if fp8 is None:
        return total
    if deepseek_costs.is_mla(hf_config):
        for index in range(hf_config["num_hidden_layers"]):
            for name, rows, columns, count in deepseek_costs.layer_projections(hf_config, index, active):
                if fp8.quantizes(f"model.layers.{index}.{name}"):
                    total += count * (rows * columns * (1 - dtype_bytes) + _scale_count(fp8, rows, columns) * scale_bytes)
        return total
    for index in range(hf_config["num_hidden_layers"]):
        for name, (rows, columns) in projection_shapes(hf_config).items():
            if fp8.quantizes(f"model.layers.{index}.{name}"):
                total += rows * columns * (1 - dtype_bytes) + _scale_count(fp8, rows, columns) * scale_bytes
    return total


def projection_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """[out, in] of each decoder layer's projections, under their checkpoint names."""
    hidden, intermediate = hf_config["hidden_size"], hf_config["intermediate_size"]
    q_width = hf_config["num_attention_heads"] * head_dim(hf_config)
    kv_width = kv_heads(hf_config) * head_dim(hf_config)
    return {"self_attn.q_proj": (q_width, hidden), "self_attn.k_proj": (kv_width, hidden),
            "self_attn.v_proj": (kv_width, hidden), "self_attn.o_proj": (hidden, q_width),
            "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
            "mlp.down_proj": (hidden, intermediate)}


# The projections each decoder layer runs as one matrix (flare.models.layers: qkv_linear, gate_up_linear).
FUSED_PROJECTIONS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                     ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _scale_count(fp8, rows: int, columns: int) -> int:
    if fp8.granularity == "block":
        return -(-rows // fp8.block[0]) * -(-columns // fp8.block[1])
    return rows if fp8.granularity == "channel" else 1
