"""DeepSeek V4 (DeepseekV4ForCausalLM): compressed sparse attention, hyper-connections, hash and top-k experts.

The memory cost model here replaces the dense decoder's (flare.recipes.base dispatches to it for V4
configs): the KV cache is the cache spec's (flare.models.cache_spec), whose "tokens" pages cost
~6.7 KiB per token at V4-Flash's widths against ~48 KiB for full-attention MLA at the same layer count,
and whose window pages are a fixed pool per active request. The single KV head is read by every query
head, so each tensor-parallel rank keeps the whole cache (it is not divided by the TP size).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from flare.recipes.base import (DECODE_CAPACITIES, BF16_BYTES, FLOAT32_BYTES, Checkpoint, ConcurrencyRange, Recipe,
                                SamplingDefaults, Speculation, sampling_ranges)

ARCHITECTURE = "DeepseekV4ForCausalLM"
PAGE_SIZE = 128                         # a multiple of both compression rates (4, 128): one HCA entry a page
INDEXER_QUERY_BLOCK = 512               # queries whose indexer scores are held at once (flare.kernels.compressed_attention)
FP8_BYTES = 1
E8M0_BYTES = 1

# deepseek-ai/DeepSeek-V4-Flash's config.json (a public report of the published file; transformers 5.25
# reads every key below). compress_ratios has one entry per layer and one for the MTP layer (0).
FLASH_CONFIG = {
    "architectures": [ARCHITECTURE], "model_type": "deepseek_v4", "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "qk_rope_head_dim": 64, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "rms_norm_eps": 1e-06, "vocab_size": 129280, "max_position_embeddings": 1048576,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}


def stored_bytes(config: Mapping[str, Any]) -> int:
    """Bytes of tensor data in a published V4 checkpoint, from its shapes: FP8 e4m3 projections with one E8M0
    scale per 128x128 block, routed experts as FP4 (two values a byte, an E8M0 scale per 32), the
    compressors, indexer scorers, router, embeddings and norms in bfloat16, hyper-connections, sinks, `ape`
    and router biases in float32, `tid2eid` int64, and the MTP layer (a sliding-window layer with
    `e_proj` / `h_proj`, its norms and its own hc head). V4-Flash: 159,609,485,896 (148.65 GiB, as a public
    listing of its 46 files reports)."""
    from flare.models.config import ModelConfig

    cfg = ModelConfig.from_hf_config(dict(config))
    layout, hidden = cfg.v4, cfg.hidden_size
    total = 2 * cfg.vocab_size * hidden * BF16_BYTES + hidden * BF16_BYTES + _hc_head_bytes(cfg)
    for index, kind in enumerate(layout.layer_types):
        total += _layer_bytes(cfg, kind, hashed=layout.mlp_layer_types[index] == "hash_moe")
    for _ in range(layout.num_mtp_layers):
        total += (_layer_bytes(cfg, "sliding_attention", hashed=False) + 2 * _fp8_bytes(hidden, hidden)
                  + 3 * hidden * BF16_BYTES + _hc_head_bytes(cfg))
    return total


def _fp8_bytes(rows: int, columns: int) -> int:
    return rows * columns * FP8_BYTES + -(-rows // 128) * -(-columns // 128) * E8M0_BYTES


def _fp4_bytes(rows: int, columns: int) -> int:
    return rows * columns // 2 + rows * (columns // 32) * E8M0_BYTES


def _hc_head_bytes(cfg) -> int:
    n = cfg.v4.hc_mult
    return (n * n * cfg.hidden_size + n + 1) * FLOAT32_BYTES


def _layer_bytes(cfg, kind: str, hashed: bool) -> int:
    layout, hidden, heads, dim = cfg.v4, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    n, inter, rate = layout.hc_mult, layout.moe_intermediate_size, layout.rate(kind)
    attention = (_fp8_bytes(layout.q_lora_rank, hidden) + _fp8_bytes(heads * dim, layout.q_lora_rank)
                 + _fp8_bytes(dim, hidden) + _fp8_bytes(layout.o_groups * layout.o_lora_rank, heads * dim // layout.o_groups)
                 + _fp8_bytes(hidden, layout.o_groups * layout.o_lora_rank) + heads * FLOAT32_BYTES
                 + (layout.q_lora_rank + dim) * BF16_BYTES)
    if rate:
        overlap = 2 if kind == "compressed_sparse_attention" else 1
        attention += _compressor_bytes(hidden, overlap * dim, rate, dim)
    if kind == "compressed_sparse_attention":
        index = layout.index_heads * layout.index_head_dim
        attention += (_compressor_bytes(hidden, 2 * layout.index_head_dim, rate, layout.index_head_dim)
                      + layout.index_heads * hidden * BF16_BYTES + _fp8_bytes(index, layout.q_lora_rank))
    experts = layout.num_experts * (2 * _fp4_bytes(inter, hidden) + _fp4_bytes(hidden, inter))
    shared = 2 * _fp8_bytes(inter, hidden) + _fp8_bytes(hidden, inter)
    router = layout.num_experts * hidden * BF16_BYTES + (
        cfg.vocab_size * layout.experts_per_token * 8 if hashed else layout.num_experts * FLOAT32_BYTES)
    hyper = 2 * ((2 + n) * n * n * hidden + (2 + n) * n + 3) * FLOAT32_BYTES
    return attention + experts + shared + router + hyper + 2 * hidden * BF16_BYTES


def _compressor_bytes(hidden: int, projected: int, rate: int, width: int) -> int:
    return 2 * projected * hidden * BF16_BYTES + rate * projected * FLOAT32_BYTES + width * BF16_BYTES


# ---- memory cost model (flare.recipes.base dispatches here for V4 configs) --------------------------


def _config(hf_config: Mapping[str, Any]):
    from flare.models.config import ModelConfig

    return ModelConfig.from_hf_config(dict(hf_config))


def cache_spec_of(hf_config: Mapping[str, Any], dtype_bytes: int = BF16_BYTES, page_size: int = PAGE_SIZE):
    from flare.models.cache_spec import cache_spec

    return cache_spec(_config(hf_config), page_size, dtype_bytes)


def kv_bytes_per_token(hf_config: Mapping[str, Any], dtype_bytes: int = BF16_BYTES) -> int:
    """Bytes each token of a long context costs on each rank: the "tokens" pages' rows (compressed entries
    and indexer keys) over the tokens they cover."""
    spec = cache_spec_of(hf_config, dtype_bytes, _smallest_page(hf_config))
    return -(-spec.tokens_page_bytes // spec.page_size)


def window_pool_bytes(hf_config: Mapping[str, Any], max_concurrency: int, prompt_tokens: int, page_size: int,
                      dtype_bytes: int = BF16_BYTES) -> int:
    """The window pages' pool (CacheSpec.window_pages_for, plus the padding rows' page) on each rank."""
    spec = cache_spec_of(hf_config, dtype_bytes, page_size)
    return (spec.window_pages_for(max_concurrency, prompt_tokens) + 1) * spec.window_page_bytes


def activation_bytes_per_token(hf_config: Mapping[str, Any], tensor_parallel: int = 1) -> int:
    """Peak activation bytes of one token inside a layer: the streams and their mixing, the query LoRA and
    the 64 x 512 query and output, the grouped projection, the compressors' and indexer's projections,
    and the routed experts' and shared expert's gate/up (bf16)."""
    cfg = _config(hf_config)
    layout, hidden = cfg.v4, cfg.hidden_size
    heads = cfg.num_attention_heads // tensor_parallel
    width = (3 * layout.hc_mult * hidden + layout.q_lora_rank + 2 * heads * cfg.head_dim
             + layout.o_groups * layout.o_lora_rank + 4 * cfg.head_dim
             + layout.index_heads * layout.index_head_dim + 4 * layout.index_head_dim
             + 2 * (layout.experts_per_token + 1) * layout.moe_intermediate_size)
    return width * BF16_BYTES


def indexer_scratch_bytes(hf_config: Mapping[str, Any], max_context: int) -> int:
    """The lightning indexer's float32 scores for one block of queries against every entry of the longest
    context (and the sort's indices beside them)."""
    rate = _config(hf_config).v4.rate("compressed_sparse_attention") or 4
    return INDEXER_QUERY_BLOCK * -(-max_context // rate) * (FLOAT32_BYTES + 8)


def decode_weight_bytes(hf_config: Mapping[str, Any]) -> int:
    """Weight bytes one decode step reads for one request: every layer's attention and shared expert, its
    router, the six routed experts it chooses (stored FP4), and the output projection."""
    cfg = _config(hf_config)
    layout = cfg.v4
    every = stored_bytes(hf_config) - 2 * cfg.vocab_size * cfg.hidden_size * BF16_BYTES
    inter, hidden = layout.moe_intermediate_size, cfg.hidden_size
    expert = 2 * _fp4_bytes(inter, hidden) + _fp4_bytes(hidden, inter)
    idle = (layout.num_experts - layout.experts_per_token) * expert * (len(layout.layer_types) + layout.num_mtp_layers)
    tables = sum(cfg.vocab_size * layout.experts_per_token * 8 for kind in layout.mlp_layer_types if kind == "hash_moe")
    return every - idle - tables + cfg.vocab_size * hidden * BF16_BYTES


def _smallest_page(hf_config: Mapping[str, Any]) -> int:
    """A page size holding whole rows of every component (the largest compression rate)."""
    layout = _config(hf_config).v4
    return max([layout.rate(kind) for kind in layout.layer_types] + [1])


def is_deepseek_v4(hf_config: Mapping[str, Any]) -> bool:
    return ARCHITECTURE in (hf_config.get("architectures") or ()) or hf_config.get("model_type") == "deepseek_v4"


# The model card's (and vLLM's recipe's, quoting it) recommended sampling: temperature 1.0, top-p 1.0.
SAMPLING = SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, ranges=sampling_ranges(),
                            source="DeepSeek-V4-Flash model card (temperature 1.0, top-p 1.0)")

# The MTP layer is the native draft; until it runs as one, the recipe speculates with history drafts only.
SPECULATION = Speculation(available=True, default_draft_tokens=4, max_draft_tokens=8, history=True,
                          note="drafts copied from decoded history (flare run --history-drafts); the checkpoint's "
                               "MTP layer is not yet run as a draft")

# The revision is a commit quoted for this repository in public deployments (hub snapshot paths); several
# other snapshots are quoted too, and which is current could not be confirmed.
CHECKPOINTS = (
    Checkpoint(alias="deepseek-v4-flash", architecture=ARCHITECTURE, served_name="DeepSeek-V4-Flash",
               repo_id="deepseek-ai/DeepSeek-V4-Flash", revision="6976c7ff1b30a1b2cb7805021b8ba4684041f136",
               stored_bytes=stored_bytes(FLASH_CONFIG), decode_weight_bytes=decode_weight_bytes(FLASH_CONFIG),
               config=FLASH_CONFIG),
)

# The spec's deepseek-v4.1-flash alias (the field report's deepseek-ai/DeepSeek-V4.1-Flash-1017 at
# 1bae0e1088993b9b82de08f59de5be5a34e42170) is not declared: neither that repository nor its revision could
# be found in public sources, and the published DeepSeek-V4.1-Flash is a multimodal checkpoint of another
# architecture (DeepseekV41ForCausalLM, per public copies of its config.json) that transformers 5.25 does not
# have. `WITHHELD` makes the alias say so instead of "unknown".
WITHHELD = {"deepseek-v4.1-flash": (
    "the deepseek-v4.1-flash checkpoint (deepseek-ai/DeepSeek-V4.1-Flash-1017) is not served: its repository "
    "and revision could not be confirmed, and DeepSeek V4.1 is a multimodal architecture "
    "(DeepseekV41ForCausalLM) that Flare does not implement; use deepseek-v4-flash")}


class DeepseekV4Recipe(Recipe):
    def tensor_parallel_sizes_for(self, hf_config: Mapping[str, Any]) -> tuple[int, ...]:
        """Sizes that split the query heads and the grouped output projection; the one KV head is read by
        every rank whole, so it does not limit them."""
        heads = hf_config.get("num_attention_heads", 64)
        groups = hf_config.get("o_groups", 8)
        return tuple(size for size in self.tensor_parallel_sizes if heads % size == 0 and groups % size == 0)

    def cache_help(self, checkpoint: Checkpoint) -> list[tuple[str, str]]:
        """The cache per token at the checkpoint's context against full-attention MLA, the window pages per
        request, and the weights each GPU holds at every tensor-parallel size."""
        from flare.models.cache_spec import mla_bytes_per_token

        config = checkpoint.config
        spec = cache_spec_of(config)
        context = config["max_position_embeddings"]
        per_token = kv_bytes_per_token(config)
        mla = mla_bytes_per_token(_config(config), BF16_BYTES)
        window = spec.window_pages_per_request * spec.window_page_bytes
        rows = [("KV cache", f"{per_token:,} bytes per cached token, {spec.sequence_bytes(context) / 2**30:.1f} GiB "
                             f"for one {context:,}-token context (full-attention MLA at {len(_config(config).v4.layer_types)} "
                             f"layers: {mla:,} bytes, {mla * context / 2**30:.1f} GiB); every GPU holds it whole; "
                             "--kv-cache-dtype fp8 is not supported"),
                ("window pages", f"{window / 2**20:,.0f} MiB per active request ({spec.window_pages_per_request} pages "
                                 f"of {spec.window_page_bytes / 2**20:.1f} MiB: sliding keys and compressor inputs) "
                                 "and a step's prompt tokens")]
        if checkpoint.stored_bytes:
            sizes = ", ".join(f"TP{size} {checkpoint.stored_bytes / size / 2**30:.1f} GiB"
                              for size in self.tensor_parallel_sizes_for(config))
            rows.append(("memory", f"weights per GPU: {sizes}; export refuses (section 6) a size whose GPUs cannot "
                                   "hold the weights, graphs, live state, window pages and the minimum KV pages"))
        return rows


RECIPE = DeepseekV4Recipe(
    family="deepseek-v4",
    title="DeepSeek V4",
    architectures=(ARCHITECTURE,),
    checkpoints=CHECKPOINTS,
    tensor_parallel_sizes=(1, 2, 4, 8),
    concurrency=ConcurrencyRange(minimum=1, default=32, maximum=256),
    page_size=PAGE_SIZE,
    prefill_chunk=4096,                  # spec section 4: 4,096 tokens for DeepSeek
    decode_capacities=DECODE_CAPACITIES,
    speculation=SPECULATION,
    sampling=SAMPLING,
)
