"""DeepSeekMoE: the router's choice of experts per token (V2's softmax top-k, V3's grouped sigmoid with its
correction bias), the shared experts, and the call into the routed experts.

Routing follows transformers' DeepseekV2TopkRouter and DeepseekV3TopkRouter exactly (float32 logits from
the float32 router weight, the same masks and order of operations), so the experts chosen are the same:

* "softmax_greedy" (V2): the top-k of softmax(logits); weights are those probabilities.
* "softmax_group_limited" (V2 group_limited_greedy): experts outside the `groups_per_token` groups with
  the highest single expert score are zeroed before the top-k.
* "sigmoid_grouped" (V3 noaux_tc): scores = sigmoid(logits); the choice ranks scores + bias
  (e_score_correction_bias) within the groups whose two best biased scores sum highest; the weights are
  the chosen experts' unbiased scores, divided by their sum when `normalize` (norm_topk_prob).

Every method then multiplies the weights by `scaling_factor` (routed_scaling_factor). The layer's output
is the routed experts' weighted sum plus the shared experts' MLP of the same input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flare.models.config import DeepseekMoe, ModelConfig
from flare.models.layers import GatedMLP, _parameter


def route(logits: torch.Tensor, moe: DeepseekMoe, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
    k = moe.experts_per_token
    if moe.method == "sigmoid_grouped":
        scores = logits.sigmoid()
        biased = scores + correction_bias
        group_scores = biased.view(-1, moe.num_groups, moe.num_experts // moe.num_groups).topk(2, dim=-1)[0].sum(-1)
        chosen = _best_groups(biased, group_scores, moe, float("-inf"))
        ids = torch.topk(chosen, k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if moe.method == "softmax_group_limited":
            group_scores = scores.view(-1, moe.num_groups, moe.num_experts // moe.num_groups).max(dim=-1).values
            scores = _best_groups(scores, group_scores, moe, 0.0)
        weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    return weights * moe.scaling_factor, ids


def _best_groups(scores: torch.Tensor, group_scores: torch.Tensor, moe: DeepseekMoe, hidden: float) -> torch.Tensor:
    """`scores` with every expert outside the `groups_per_token` best groups set to `hidden`."""
    best = torch.topk(group_scores, k=moe.groups_per_token, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep[:, :, None].expand(-1, -1, moe.num_experts // moe.num_groups).reshape(-1, moe.num_experts)
    return scores.masked_fill(~keep, hidden)


class Router(nn.Module):
    """`mlp.gate`: float32 logits from a float32 weight (transformers keeps it so), and V3's correction bias."""

    def __init__(self, hidden: int, moe: DeepseekMoe) -> None:
        super().__init__()
        self.moe = moe
        self.weight = _parameter(moe.num_experts, hidden, dtype=torch.float32)
        self.e_score_correction_bias = (_parameter(moe.num_experts, dtype=torch.float32)
                                        if moe.method == "sigmoid_grouped" else None)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.weight)
        return route(logits, self.moe, self.e_score_correction_bias)


def expert_mlps(cfg: ModelConfig, moe: DeepseekMoe, prefix: str) -> nn.ModuleList:
    """The routed experts, each a SwiGLU MLP named as the checkpoint names it (`<prefix>.<e>.gate_proj`, ...)."""
    return nn.ModuleList(GatedMLP(cfg.hidden_size, moe.moe_intermediate_size,
                                  cfg.fp8_projection(f"{prefix}.{e}", ("gate_proj", "up_proj")),
                                  cfg.fp8_projection(f"{prefix}.{e}", ("down_proj",)))
                         for e in range(moe.num_experts))


def run_experts(experts: nn.ModuleList, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], topk_weights [T, k] float32, topk_ids [T, k] -> [T, H]: each token's chosen experts,
    weighted and summed. The seam a stacked-experts kernel takes over (it computes the same from the same
    two routing tensors); here each chosen expert runs on its tokens, accumulated in expert order as
    transformers' expert loop does. Its `unique` reads the ids on the host: not for captured graphs."""
    out = torch.zeros_like(hidden)
    for expert in torch.unique(topk_ids).tolist():
        tokens, choice = torch.where(topk_ids == expert)
        y = experts[expert](hidden[tokens]) * topk_weights[tokens, choice, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class DeepseekMoeLayer(nn.Module):
    """`mlp` of a DeepSeek layer from `first_k_dense_replace` on: routed experts plus shared experts."""

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        super().__init__()
        moe = cfg.deepseek_moe
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = expert_mlps(cfg, moe, f"{prefix}.experts")
        self.shared_experts = (GatedMLP(cfg.hidden_size, moe.moe_intermediate_size * moe.num_shared_experts,
                                        cfg.fp8_projection(f"{prefix}.shared_experts", ("gate_proj", "up_proj")),
                                        cfg.fp8_projection(f"{prefix}.shared_experts", ("down_proj",)))
                               if moe.num_shared_experts else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)
        out = run_experts(self.experts, hidden, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
