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
    the final hidden states `[T, H]`) and `self.lm_head` (an `LMHead`). A module with a `finish_loading()`
    has it called once every tensor is loaded (a layer that converts what it loaded).
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
        targets = {name: (param, shard) for param_name, param in params.items()
                   for name, shard in checkpoint_targets(param_name, param)}
        unused = unused_checkpoint_names(self)
        loaded: set[str] = set()
        separate_head = None
        for name, tensor in weights:
            if IGNORED_TENSORS.match(name) or name in unused or self.loads_elsewhere(name):
                continue
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                # Tied embeddings: decided once the embedding is loaded. A copy, because weight sources may
                # reuse their buffers for later tensors (flare.package.weights.iter_tensors_pinned).
                separate_head = tensor.clone()
                continue
            if name not in targets:
                raise WeightError(f"checkpoint tensor {name} is not part of this {type(self).__name__} model"
                                  + _scale_hint(name))
            if name in loaded:
                raise WeightError(f"checkpoint tensor {name} appears twice in the checkpoint")
            param, shard = targets[name]
            param.weight_loader(param, tensor, shard, name)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            what = f"tensor {missing[0]} is" if len(missing) == 1 else f"tensors {missing[0]} and {len(missing) - 1} more are"
            raise WeightError(f"checkpoint {what} missing; the checkpoint is incomplete")
        if separate_head is not None:
            self._tie_or_untie(separate_head)
        for module in self.modules():
            if hasattr(module, "finish_loading"):
                module.finish_loading()

    def loads_elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to another model the checkpoint carries (a DeepSeek
        checkpoint's multi-token-prediction layers: its draft), so this one passes it by."""
        return False

    def _tie_or_untie(self, head: torch.Tensor) -> None:
        # transformers keeps the embeddings tied when the checkpoint's lm_head equals them, and unties otherwise.
        embedding = self.lm_head.matrix
        if head.shape == embedding.shape and torch.equal(head.to(embedding.device, embedding.dtype), embedding):
            return
        self.lm_head.untie(head, "lm_head.weight")


def checkpoint_targets(param_name: str, param: nn.Parameter) -> list[tuple[str, str | None]]:
    """The checkpoint tensors that together fill one of our parameters, each with the shard it fills.

    `...self_attn.qkv_proj.bias` -> `...self_attn.q_proj.bias` ("q"), `k_proj` ("k"), `v_proj` ("v");
    a parameter may load from a tensor named otherwise (`checkpoint_suffix`: an FP8 scale's
    `weight_scale_inv`)."""
    parts = param_name.split(".")
    suffix = getattr(param, "checkpoint_suffix", parts[-1])
    shards = [shard for shard in param.shards if shard is not None]
    if not shards:
        return [(".".join([*parts[:-1], suffix]), None)]
    by_shard = {shard: proj for proj, (fused, shard) in FUSED_PROJECTIONS.items() if fused == parts[-2]}
    return [(".".join([*parts[:-2], by_shard[shard], suffix]), shard) for shard in shards]


def unused_checkpoint_names(model: nn.Module) -> set[str]:
    """Checkpoint tensors a layer accepts and does not need (`unused_tensors`: FP8 static input scales),
    under the checkpoint's names of the projections it fuses."""
    names = set()
    for module_name, module in model.named_modules():
        suffixes = getattr(module, "unused_tensors", ())
        parts = module_name.split(".")
        projections = [proj for proj, (fused, _) in FUSED_PROJECTIONS.items() if fused == parts[-1]] or [parts[-1]]
        names.update(".".join([*parts[:-1], proj, suffix]) for proj in projections for suffix in suffixes)
    return names


def _scale_hint(name: str) -> str:
    if name.rsplit(".", 1)[-1] in ("weight_scale_inv", "weight_scale", "input_scale"):
        return ("; it is an FP8 scale of a projection the model keeps unquantized: the checkpoint does not match "
                "the quantization_config of its config.json")
    return ""
