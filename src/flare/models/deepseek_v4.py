"""DeepSeek V4 (DeepseekV4ForCausalLM): hyper-connected decoder layers of sliding-window, compressed
sparse (CSA) and heavily compressed (HCA) attention, and hash-routed or top-k routed experts.

The math is transformers' `models/deepseek_v4` (and the V4 paper, sections 2.1-2.3), computed over
Flare's paged cache (flare.models.cache_spec, flare.engine.layer_cache) one step at a time:

* attention: query LoRA (wq_a, q_norm, wq_b, then an unweighted RMS norm per head), one KV head
  (wkv, kv_norm) read as key and value, rotary on the last `rope_dim` channels (pairs interleaved; the
  "main" rope on sliding layers, the "compress" rope on compressed ones), a learned sink per head, the
  output rotated back by the query's angle, then the grouped low-rank projection (wo_a per group, wo_b);
* every layer attends to its last `sliding_window` tokens; a compressed layer also to its compressed
  entries: each closed window of `m` tokens pooled by a softmax gate (wkv, wgate, `ape` per slot), RMS
  normalised and rotated at the window's first position. CSA's windows overlap by one (entry w pools the
  second half of window w's projections with the first half of window w-1's), and its lightning indexer
  keeps the `index_topk` entries it scores highest per query; HCA reads every entry the query may see
  (those whose window closed at or before it);
* experts: sqrt(softplus) (or sigmoid) scores; hash layers take their experts from `tid2eid[token]`, the
  others the top-k of scores + `gate.bias`; weights normalised and scaled by `routed_scaling_factor`;
  gate and up clipped to `swiglu_limit` before SiLU; one shared expert (clipped alike) beside them;
* hyper-connections (flare.models.hyper_connections) around each attention and feed-forward block.

Parameters are named as DeepSeek publishes them (`layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.3.w1
.weight`, `hc_head_fn`, `embed.weight`, `head.weight`; `deepseek_name` reads transformers' save_pretrained
names into these), experts stacked per layer. The attention itself runs
flare.kernels.compressed_attention (Triton) on a Triton backend, its torch reference elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flare.models.causal_lm import CausalLM
from flare.models.config import ModelConfig, RopeConfig
from flare.models.deepseek_v4_config import CSA, HASH_MOE, HCA, SLIDING, V4Rope
from flare.models.errors import WeightError
from flare.models.hyper_connections import collapse_head, expand, mixing_weights
from flare.models.layers import Embedding, _parameter, load_rows, plain_linear
from flare.models.rotary import inverse_frequencies


# ---- small layers ----------------------------------------------------------------------------------


class V4RMSNorm(nn.Module):
    """RMS norm whose float32 weight multiplies before the cast back (transformers' DeepseekV4RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter(size, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def fp32_parameter(*shape: int) -> nn.Parameter:
    return _parameter(*shape, dtype=torch.float32)


class V4Rotary(nn.Module):
    """cos and sin `[T, dim / 2]` of one of V4's rotary embeddings (one angle per interleaved pair)."""

    def __init__(self, rope: V4Rope, max_positions: int) -> None:
        super().__init__()
        standard = RopeConfig(kind=rope.kind, theta=rope.theta, factor=rope.factor,
                              original_max_positions=rope.original_max_positions, beta_fast=rope.beta_fast,
                              beta_slow=rope.beta_slow, attention_factor=rope.attention_factor, truncate=rope.truncate)
        inv_freq, self.scaling = inverse_frequencies(standard, rope.dim, max_positions)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None].float() * self.inv_freq[None, :]
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 * cos.shape[-1] channels of x [T, (heads,) C] by pairs (2i, 2i + 1), in float32, back
    in x's dtype; the leading channels pass unchanged."""
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    width = 2 * cos.shape[-1]
    plain, rotary = x[..., :-width], x[..., -width:].float()
    even, odd = rotary[..., 0::2], rotary[..., 1::2]
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([plain, rotated.to(x.dtype)], dim=-1)


@dataclass(frozen=True)
class Angles:
    cos: torch.Tensor
    sin: torch.Tensor


# ---- the step's indices, shared by every layer ----------------------------------------------------


@dataclass(frozen=True)
class ClosedWindows:
    """The compressed entries a step closes for one compression rate: a token at position p closes entry
    (p + 1) / m - 1 when p + 1 is a multiple of m."""

    rate: int
    visible: torch.Tensor          # [T] int64: entries each new token may read (those closed at or before it)
    tokens: torch.Tensor           # [E] int64: the tokens that close an entry
    entries: torch.Tensor          # [E] int64: the entry each closes
    destination: torch.Tensor      # [E] int64: its row in the flattened [pages * rows, C] entries tensor


@dataclass(frozen=True)
class V4Step:
    positions: torch.Tensor        # [T] int64
    seq_index: torch.Tensor        # [T] int64
    window_tables: torch.Tensor    # [B, blocks] int32 (window pages)
    page_tables: torch.Tensor     # [B, blocks] int32 (tokens pages)
    window_slots: torch.Tensor     # [T] int64: each new token's row in the flattened window tensors
    page_size: int
    closed: tuple[ClosedWindows, ...]

    @classmethod
    def build(cls, positions: torch.Tensor, meta, rates: tuple[int, ...]) -> V4Step:
        if meta.window_page_tables is None:
            raise ValueError("DeepSeek V4 attention needs window pages: the metadata has no window_page_tables")
        page_size = meta.page_size
        seq_index = meta.token_sequence_index().long()
        window_tables = meta.window_page_tables
        slots = window_tables[seq_index, positions // page_size].long() * page_size + positions % page_size
        closed = tuple(cls._closed(positions, seq_index, meta.page_tables, page_size, rate) for rate in rates)
        return cls(positions, seq_index, window_tables, meta.page_tables, slots, page_size, closed)

    @staticmethod
    def _closed(positions, seq_index, page_tables, page_size: int, rate: int) -> ClosedWindows:
        rows = page_size // rate
        tokens = torch.nonzero((positions + 1) % rate == 0).flatten()
        entries = (positions[tokens] + 1) // rate - 1
        pages = page_tables[seq_index[tokens], entries // rows].long()
        return ClosedWindows(rate, (positions + 1) // rate, tokens, entries, pages * rows + entries % rows)

    def windows(self, rate: int) -> ClosedWindows:
        return next(closed for closed in self.closed if closed.rate == rate)

    def window_slots_of(self, seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows in the flattened window tensors of positions [E, K] of sequences seq [E] (positions >= 0)."""
        pages = self.window_tables[seq[:, None], positions // self.page_size].long()
        return pages * self.page_size + positions % self.page_size


# ---- attention --------------------------------------------------------------------------------------


class Compressor(nn.Module):
    """Pools every closed window of `rate` tokens into one entry (CSA's overlap when `overlap`); its inputs,
    each token's key and gate projections, wait in the window pages until their windows close."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        projected = 2 * width if overlap else width
        self.wkv = plain_linear(hidden, projected)
        self.wgate = plain_linear(hidden, projected)
        self.ape = fp32_parameter(rate, projected)
        self.norm = V4RMSNorm(width, eps)

    def forward(self, hidden: torch.Tensor, inputs: torch.Tensor, entries: torch.Tensor, step: V4Step,
                rotary: V4Rotary) -> None:
        """Store the step's projections (`inputs` [window pages, page, 2 x projected]) and write every entry
        the step closes into `entries` [tokens pages, rows, width]."""
        projected = torch.cat([self.wkv(hidden), self.wgate(hidden)], dim=-1)
        flat_inputs = inputs.view(-1, inputs.shape[-1])
        flat_inputs[step.window_slots] = projected.to(inputs.dtype)
        closed = step.windows(self.rate)
        if closed.tokens.numel() == 0:
            return
        pooled = self._pool(flat_inputs, closed, step)
        first = closed.entries * self.rate
        cos, sin = rotary(first, pooled.dtype)
        entries.view(-1, self.width)[closed.destination] = rotate(self.norm(pooled), cos, sin).to(entries.dtype)

    def _pool(self, flat_inputs: torch.Tensor, closed: ClosedWindows, step: V4Step) -> torch.Tensor:
        """[E, width]: each closed window's keys, weighted by the softmax of their gates (float32) over its
        slots; CSA's slots are the previous window's first halves, then this window's second halves."""
        rate, width = self.rate, self.width
        seq = step.seq_index[closed.tokens]
        first = closed.entries * rate
        span = 2 * rate if self.overlap else rate
        positions = first[:, None] - (rate if self.overlap else 0) + torch.arange(span, device=first.device)[None, :]
        present = positions >= 0
        rows = flat_inputs[step.window_slots_of(seq, positions.clamp(min=0))]      # [E, span, 2 x projected]
        projected = rows.shape[-1] // 2
        kv, gate = rows[..., :projected], rows[..., projected:]
        if self.overlap:        # slot j < m: window w-1's first half; slot j >= m: window w's second half
            earlier = torch.arange(span, device=first.device) < rate
            kv = torch.where(earlier[None, :, None], kv[..., :width], kv[..., width:])
            gate = torch.where(earlier[None, :, None], gate[..., :width], gate[..., width:])
            bias = torch.cat([self.ape[:, :width], self.ape[:, width:]], dim=0)
        else:
            bias = self.ape
        gate = gate + bias                                                           # float32, as transformers adds it
        gate = gate.masked_fill(~present[..., None], float("-inf"))
        kv = kv.masked_fill(~present[..., None], 0)
        return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


class Indexer(nn.Module):
    """The lightning indexer: its own overlapping compressor at `index_head_dim`, and per query
    sum_h w_h relu(q_h . k) over the compressed keys, of which it keeps the top `index_topk`."""

    def __init__(self, cfg: ModelConfig, rate: int) -> None:
        super().__init__()
        layout = cfg.v4
        self.heads, self.head_dim, self.topk = layout.index_heads, layout.index_head_dim, layout.index_topk
        self.wq_b = plain_linear(layout.q_lora_rank, self.heads * self.head_dim)
        self.weights_proj = plain_linear(cfg.hidden_size, self.heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, rate, overlap=True, eps=cfg.rms_norm_eps)

    def forward(self, hidden, q_residual, angles: Angles, cache, step: V4Step, rotary: V4Rotary, ops) -> torch.Tensor:
        self.compressor(hidden, cache.indexer_inputs, cache.indexer_keys, step, rotary)
        query = rotate(self.wq_b(q_residual).view(hidden.shape[0], self.heads, self.head_dim), angles.cos, angles.sin)
        weights = self.weights_proj(hidden).float() * self.heads**-0.5
        visible = step.windows(self.compressor.rate).visible
        return ops.indexer_topk(query, weights, cache.indexer_keys, step.page_tables, step.seq_index, visible,
                                self.head_dim**-0.5, self.topk)


class V4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str) -> None:
        super().__init__()
        layout = cfg.v4
        self.cfg, self.layer_type = cfg, layer_type
        self.heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, layout.sliding_window
        self.groups, eps = layout.o_groups, cfg.rms_norm_eps
        self.wq_a = plain_linear(cfg.hidden_size, layout.q_lora_rank)
        self.q_norm = V4RMSNorm(layout.q_lora_rank, eps)
        self.wq_b = plain_linear(layout.q_lora_rank, self.heads * self.head_dim)
        self.wkv = plain_linear(cfg.hidden_size, self.head_dim)
        self.kv_norm = V4RMSNorm(self.head_dim, eps)
        # Grouped output projection: wo_a holds each group's [o_lora_rank, heads * head_dim / groups] block.
        self.wo_a = plain_linear(self.heads * self.head_dim // self.groups, self.groups * layout.o_lora_rank)
        self.wo_b = plain_linear(self.groups * layout.o_lora_rank, cfg.hidden_size)
        self.attn_sink = fp32_parameter(self.heads)
        rate = layout.rate(layer_type)
        self.compressor = (Compressor(cfg.hidden_size, self.head_dim, rate, layer_type == CSA, eps)
                           if layer_type != SLIDING else None)
        self.indexer = Indexer(cfg, rate) if layer_type == CSA else None

    def forward(self, hidden, angles: Angles, cache, step: V4Step, rotary: V4Rotary, ops) -> torch.Tensor:
        tokens, eps = hidden.shape[0], self.cfg.rms_norm_eps
        q_residual = self.q_norm(self.wq_a(hidden))
        query = unweighted_rms_norm(self.wq_b(q_residual).view(tokens, self.heads, self.head_dim), eps)
        query = rotate(query, angles.cos, angles.sin)
        kv = rotate(self.kv_norm(self.wkv(hidden)), angles.cos, angles.sin)
        cache.window_kv.view(-1, self.head_dim)[step.window_slots] = kv.to(cache.window_kv.dtype)
        compressed = {}
        if self.compressor is not None:
            self.compressor(hidden, cache.compressor_inputs, cache.compressed, step, rotary)
            compressed = {"entries": cache.compressed, "page_tables": step.page_tables}
            if self.indexer is not None:
                compressed["entry_ids"] = self.indexer(hidden, q_residual, angles, cache, step, rotary, ops)
            else:
                compressed["entry_counts"] = step.windows(self.compressor.rate).visible
        out = ops.sparse_attention(query, cache.window_kv, step.window_tables, step.seq_index, step.positions,
                                   self.window, self.attn_sink, self.head_dim**-0.5, **compressed)
        out = rotate(out, angles.cos, -angles.sin).reshape(tokens, self.groups, -1)
        weight = self.wo_a.weight.view(self.groups, -1, out.shape[-1])
        return self.wo_b(torch.einsum("tgi,goi->tgo", out, weight.to(out.dtype)).flatten(1))


# ---- experts ---------------------------------------------------------------------------------------


def clipped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), gate and up the two halves of gate_up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(nn.Module):
    """`ffn.gate`: scores from `weight`; experts from `tid2eid` (hash layers) or the top-k of score + bias."""

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        layout = cfg.v4
        self.top_k, self.scale, self.scoring = layout.experts_per_token, layout.routed_scaling_factor, layout.scoring_func
        self.weight = _parameter(layout.num_experts, cfg.hidden_size)
        if hashed:
            self.tid2eid = _parameter(cfg.vocab_size, self.top_k, dtype=torch.int64)
            self.tid2eid.weight_loader = load_indices
        else:
            self.bias = fp32_parameter(layout.num_experts)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] int64, their weights [T, k])."""
        logits = F.linear(hidden, self.weight)
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else torch.sigmoid(logits)
        if hasattr(self, "tid2eid"):
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


def load_indices(param: nn.Parameter, tensor: torch.Tensor, shard, name: str) -> None:
    """An integer table (tid2eid): its shape checked, copied as int64, and refused if an id leaves [0, bound)."""
    if tuple(tensor.shape) != tuple(param.shape) or tensor.is_floating_point():
        raise WeightError(f"checkpoint tensor {name} is {str(tensor.dtype).removeprefix('torch.')} "
                          f"{list(tensor.shape)}; the model expects integer expert ids {list(param.shape)}")
    param.data.copy_(tensor)


class StackedExperts(nn.Module):
    """`ffn.experts.E.w1/w2/w3`, stacked: w13 [E, 2I, H] (each expert's w1 rows, then its w3 rows), w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w13 = _parameter(num_experts, 2 * intermediate, hidden)
        self.w2 = _parameter(num_experts, hidden, intermediate)
        for param in (self.w13, self.w2):
            param.weight_loader = load_expert

    def checkpoint_names(self, prefix: str) -> list[tuple[str, nn.Parameter, tuple[int, str]]]:
        names = []
        for expert in range(self.w13.shape[0]):
            for part, param in (("w1", self.w13), ("w3", self.w13), ("w2", self.w2)):
                names.append((f"{prefix}.{expert}.{part}.weight", param, (expert, part)))
        return names

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's experts weighted and summed, expert by expert in id order as transformers sums them."""
        out = torch.zeros_like(hidden)
        for expert in torch.unique(ids).tolist():
            tokens, choice = torch.where(ids == expert)
            y = F.linear(clipped_swiglu(F.linear(hidden[tokens], self.w13[expert]), self.limit), self.w2[expert])
            out.index_add_(0, tokens, (y * weights[tokens, choice, None]).to(out.dtype))
        return out


def load_expert(param: nn.Parameter, tensor: torch.Tensor, shard: tuple[int, str], name: str) -> None:
    expert, part = shard
    rows = param.shape[1] // 2 if part in ("w1", "w3") else param.shape[1]
    start = rows if part == "w3" else 0
    expected = (rows, param.shape[2])
    if tuple(tensor.shape) != expected:
        raise WeightError(f"checkpoint tensor {name} has shape {list(tensor.shape)} but the model expects "
                          f"{list(expected)}; the checkpoint does not match its config.json")
    param.data[expert, start:start + rows].copy_(tensor)


class SharedExpert(nn.Module):
    """`ffn.shared_experts.w1/w2/w3`: the clipped SwiGLU every token runs (w1 and w3 as one matrix)."""

    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        from flare.models.layers import linear

        self.limit = limit
        self.w13 = linear(hidden, {"w1": intermediate, "w3": intermediate})
        self.w2 = plain_linear(intermediate, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.w2(clipped_swiglu(self.w13(hidden), self.limit))


class V4MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        layout = cfg.v4
        self.gate = Router(cfg, hashed)
        self.experts = StackedExperts(layout.num_experts, cfg.hidden_size, layout.moe_intermediate_size,
                                      layout.swiglu_limit)
        self.shared_experts = SharedExpert(cfg.hidden_size, layout.moe_intermediate_size, layout.swiglu_limit)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(hidden, input_ids)
        return self.experts(hidden, ids, weights) + self.shared_experts(hidden)


# ---- layers and model -----------------------------------------------------------------------------


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        layout = cfg.v4
        self.cfg, self.layer_type = cfg, layout.layer_types[index]
        n, hidden = layout.hc_mult, cfg.hidden_size
        self.attn_norm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        self.attn = V4Attention(cfg, self.layer_type)
        self.ffn_norm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        self.ffn = V4MoE(cfg, layout.mlp_layer_types[index] == HASH_MOE)
        for block in ("attn", "ffn"):
            setattr(self, f"hc_{block}_fn", fp32_parameter((2 + n) * n, n * hidden))
            setattr(self, f"hc_{block}_base", fp32_parameter((2 + n) * n))
            setattr(self, f"hc_{block}_scale", fp32_parameter(3))

    def _mix(self, block: str, streams: torch.Tensor):
        layout = self.cfg.v4
        return mixing_weights(streams, getattr(self, f"hc_{block}_fn"), getattr(self, f"hc_{block}_base"),
                              getattr(self, f"hc_{block}_scale"), layout.hc_sinkhorn_iters, layout.hc_eps,
                              self.cfg.rms_norm_eps)

    def forward(self, streams, input_ids, angles: Angles, cache, step: V4Step, rotary: V4Rotary, ops):
        post, comb, collapsed = self._mix("attn", streams)
        out = self.attn(self.attn_norm(collapsed), angles, cache, step, rotary, ops)
        streams = expand(out, post, comb, streams)
        post, comb, collapsed = self._mix("ffn", streams)
        return expand(self.ffn(self.ffn_norm(collapsed), input_ids), post, comb, streams)


class V4Head(nn.Module):
    """`head.weight`: hidden states to float32 logits."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = _parameter(vocab, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()


class DeepseekV4ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        layout = cfg.v4
        self.cfg = cfg
        self.ops = compressed_attention_ops(getattr(backend, "kernels", "torch"))
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, index) for index in range(cfg.num_hidden_layers))
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n = layout.hc_mult
        self.hc_head_fn = fp32_parameter(n, n * cfg.hidden_size)
        self.hc_head_base = fp32_parameter(n)
        self.hc_head_scale = fp32_parameter(1)
        self.head = V4Head(cfg.vocab_size, cfg.hidden_size)
        self.main_rotary = V4Rotary(layout.main_rope, cfg.max_position_embeddings)
        self.compress_rotary = V4Rotary(layout.compress_rope, cfg.max_position_embeddings)
        self.rates = tuple(sorted({layout.rate(kind) for kind in layout.layer_types} - {0}))

    def forward(self, input_ids, positions, kv_caches, meta):
        """`input_ids, positions [T]`, one LayerCache per layer, an AttentionMetadata with window pages -> [T, H]."""
        hidden = self.streams(input_ids, positions, kv_caches, meta)
        layout = self.cfg.v4
        return self.norm(collapse_head(hidden, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, layout.hc_eps,
                                       self.cfg.rms_norm_eps))

    def streams(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """The `hc_mult` residual streams after the last layer, [T, n, H] (what the MTP layer reads)."""
        embedded = self.embed(input_ids)
        streams = embedded[:, None, :].expand(-1, self.cfg.v4.hc_mult, -1).contiguous()
        step = V4Step.build(positions, meta, self.rates)
        angles = {"main": Angles(*self.main_rotary(positions, embedded.dtype)),
                  "compress": Angles(*self.compress_rotary(positions, embedded.dtype))}
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            kind = "main" if layer.layer_type == SLIDING else "compress"
            streams = layer(streams, input_ids, angles[kind], cache, step, self.compress_rotary, self.ops)
        return streams

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every parameter from (checkpoint name, tensor) pairs in DeepSeek's layout or transformers'
        save_pretrained layout; `mtp.*` (the MTP layer) is not part of this model. Fails naming any tensor
        that does not fit, is missing or comes twice."""
        targets = self._targets()
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = deepseek_name(raw_name)
            if name.startswith("mtp."):
                continue
            if name not in targets:
                raise WeightError(f"checkpoint tensor {raw_name} is not part of this DeepseekV4ForCausalLM model")
            if name in loaded:
                raise WeightError(f"checkpoint tensor {raw_name} appears twice in the checkpoint")
            param, shard = targets[name]
            param.weight_loader(param, tensor, shard, raw_name)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            what = f"tensor {missing[0]} is" if len(missing) == 1 else f"tensors {missing[0]} and {len(missing) - 1} more are"
            raise WeightError(f"checkpoint {what} missing; the checkpoint is incomplete")

    def _targets(self) -> dict[str, tuple[nn.Parameter, object]]:
        """Checkpoint name -> (our parameter, the shard it fills)."""
        targets: dict[str, tuple[nn.Parameter, object]] = {}
        stacked: set[int] = set()
        for module_name, module in self.named_modules():
            if isinstance(module, StackedExperts):
                for name, param, shard in module.checkpoint_names(module_name):
                    targets[name] = (param, shard)
                stacked.update(id(param) for param in (module.w13, module.w2))
        for name, param in self.named_parameters():
            if id(param) in stacked:
                continue
            shards = [shard for shard in param.shards if shard is not None] if hasattr(param, "shards") else []
            if shards:                                      # the shared expert's w13: w1 rows, then w3's
                for shard in shards:
                    targets[name.replace(".w13.", f".{shard}.")] = (param, shard)
            else:
                targets[name] = (param, None)
        return targets


# transformers' save_pretrained writes DeepSeek's names under `model.`, with the embedding, the hc head and
# the attention's kv_norm under its own names; DeepSeek's published layout has none of these.
_SAVE_PRETRAINED_NAMES = (
    (re.compile(r"^model\."), ""),
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
)


def deepseek_name(name: str) -> str:
    """A checkpoint tensor's name in DeepSeek's published layout (`layers.0.attn.wq_a.weight`)."""
    for pattern, replacement in _SAVE_PRETRAINED_NAMES:
        name = pattern.sub(replacement, name)
    return name


def compressed_attention_ops(kernels: str):
    """The module computing V4's sparse attention and indexer: Triton's kernels or their torch references."""
    if kernels == "triton":
        from flare.kernels import compressed_attention

        return compressed_attention
    from flare.kernels import compressed_attention_reference

    return ReferenceOps(compressed_attention_reference)


class ReferenceOps:
    """The torch references under the kernels' names."""

    def __init__(self, reference) -> None:
        self.sparse_attention = reference.sparse_attention_reference
        self.indexer_topk = reference.indexer_topk_reference
