"""`CausalLM`: the contract every family's model keeps, and loading checkpoint tensors into it.

A checkpoint names tensors as transformers does (`model.layers.3.self_attn.q_proj.weight`); our fused
parameters (`qkv_proj`, `gate_up_proj`) take several of them, each into its own shard.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from flare.models.errors import WeightError

# checkpoint projection name -> (our fused parameter's module, shard)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# Derived buffers that older checkpoints saved; they carry no information the config lacks.
IGNORED_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")


class CausalLM(nn.Module):
    """A decoder-only language model over a flattened batch with a paged KV cache.

    Subclasses build `self.model` (whose `forward(input_ids, positions, kv_caches, meta)` returns
    the final hidden states `[T, H]`) and `self.lm_head` (an `LMHead`).
    """

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta):
        """`input_ids, positions [T]`, one KV cache per layer, an `AttentionMetadata` -> hidden `[T, H]`."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, H]` -> float32 logits `[N, vocab]`."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load every parameter from `(checkpoint name, tensor)` pairs; fail naming any tensor that does not fit."""
        params = dict(self.named_parameters())
        expected = {name for param_name in params for name in checkpoint_names(param_name, params[param_name])}
        loaded: set[str] = set()
        separate_head = None
        for name, tensor in weights:
            if IGNORED_TENSORS.match(name):
                continue
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                # Tied embeddings: decided once the embedding is loaded. A copy, because weight sources may
                # reuse their buffers for later tensors (flare.package.weights.iter_tensors_pinned).
                separate_head = tensor.clone()
                continue
            param_name, shard = parameter_for(name)
            if name not in expected or param_name not in params:
                raise WeightError(f"checkpoint tensor {name} is not part of this {type(self).__name__} model")
            if name in loaded:
                raise WeightError(f"checkpoint tensor {name} appears twice in the checkpoint")
            param = params[param_name]
            param.weight_loader(param, tensor, shard, name)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            what = f"tensor {missing[0]} is" if len(missing) == 1 else f"tensors {missing[0]} and {len(missing) - 1} more are"
            raise WeightError(f"checkpoint {what} missing; the checkpoint is incomplete")
        if separate_head is not None:
            self._tie_or_untie(separate_head)

    def _tie_or_untie(self, head: torch.Tensor) -> None:
        # transformers keeps the embeddings tied when the checkpoint's lm_head equals them, and unties otherwise.
        embedding = self.lm_head.matrix
        if head.shape == embedding.shape and torch.equal(head.to(embedding.device, embedding.dtype), embedding):
            return
        self.lm_head.untie(head, "lm_head.weight")


def parameter_for(checkpoint_name: str) -> tuple[str, str | None]:
    """`...self_attn.k_proj.bias` -> (`...self_attn.qkv_proj.bias`, "k"); unfused names map to themselves."""
    parts = checkpoint_name.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED_PROJECTIONS:
        fused, shard = FUSED_PROJECTIONS[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return checkpoint_name, None


def checkpoint_names(param_name: str, param: nn.Parameter) -> list[str]:
    """The checkpoint tensors that together fill one of our parameters."""
    parts = param_name.split(".")
    shards = [shard for shard in param.shards if shard is not None]
    if not shards:
        return [param_name]
    by_shard = {shard: proj for proj, (fused, shard) in FUSED_PROJECTIONS.items() if fused == parts[-2]}
    return [".".join([*parts[:-2], by_shard[shard], parts[-1]]) for shard in shards]
