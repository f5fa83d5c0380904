"""Manifold-constrained hyper-connections (mHC, DeepSeek V4 paper section 2.2): `n` residual streams instead
of one, mixed into each block's input and out of its output by weights computed from the streams.

For a token with streams x [n, H] and a block f (attention or the feed-forward layer):

    flat   = x flattened to n * H and RMS-normalised (no weight)
    mixes  = flat @ fn^T                                   [(2 + n) * n]: pre, post and comb logits
    pre    = sigmoid(mixes_pre * scale[0] + base_pre) + eps
    post   = 2 * sigmoid(mixes_post * scale[1] + base_post)
    comb   = softmax(mixes_comb * scale[2] + base_comb) + eps, then Sinkhorn-projected toward a doubly
             stochastic matrix (alternate column and row normalisation, `iterations` passes in all)
    y      = f(sum_i pre_i x_i)
    x'_i   = post_i * y + sum_j comb[j, i] x_j

The head collapses the final streams once more with its own sigmoid weights. Everything here runs in
float32 (the weights are kept in float32, as transformers keeps them), and the mixed streams return to the
streams' dtype, as transformers rounds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def normalised(flat: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight, in float32."""
    flat = flat.float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def mixing_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   iterations: int, eps: float, norm_eps: float):
    """streams [T, n, H] -> (post [T, n], comb [T, n, n], collapsed block input [T, H] in streams' dtype)."""
    tokens, n, _ = streams.shape
    mixes = F.linear(normalised(streams.reshape(tokens, -1), norm_eps), fn.float())
    pre_logits, post_logits, comb_logits = mixes.split([n, n, n * n], dim=-1)
    pre_base, post_base, comb_base = base.float().split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.float().unbind(0)
    pre = torch.sigmoid(pre_logits * pre_scale + pre_base) + eps
    post = 2 * torch.sigmoid(post_logits * post_scale + post_base)
    comb = torch.softmax(comb_logits.view(tokens, n, n) * comb_scale + comb_base.view(n, n), dim=-1) + eps
    comb = sinkhorn(comb, iterations, eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def sinkhorn(comb: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Columns normalised first, then `iterations - 1` rounds of rows and columns (transformers' order)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def expand(block_output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams after a block: post_i * y + sum_j comb[j, i] x_j, in the streams' dtype ([T, n, H])."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                      streams)


def collapse_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                  norm_eps: float) -> torch.Tensor:
    """The final streams [T, n, H] as one hidden state [T, H]: sigmoid-weighted, as the model's head mixes them."""
    mixes = F.linear(normalised(streams.flatten(1), norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
