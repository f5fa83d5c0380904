"""Verification of draft tokens: which of a row's drafts the target accepts, and the token after them.

A verifying row brings the target's distributions at its 1 + k positions (p_0 .. p_k, after every
sampling control: `DeviceSampler.target_probs`) and k drafts d_0 .. d_{k-1}, each proposed from a
distribution q_j (a draft model's) or chosen deterministically (history drafts: q_j is a point mass).
Rejection sampling (Leviathan et al. 2023; Chen et al. 2023), in order:

* draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) while every draft before it was;
* at the first rejected draft j the token is drawn from the residual max(0, p_j - q_j), normalised
  (a point-mass q: p_j without d_j);
* when all k are accepted, one more token is drawn from p_k.

The tokens that come out are distributed exactly as the target's own, one at a time, whatever q is.
Greedy rows have a one-hot p (at the processed argmax): a draft is accepted exactly when it is the
argmax, and the token after is the argmax, so greedy output equals decoding without drafts.

Point-mass drafts (proposed without a distribution, as history drafts are) take `accept_matching`
instead: the target's own sample at each of the 1 + k positions (the sampler's draw with its uniforms
for that position, exactly as decoding without drafts draws it) is compared with the draft there, and
the drafts are accepted while they match. A draft d is then accepted with probability p(d), and on a
rejection the token is the sample itself, distributed as p without d: the point-mass case of the rule
above, so the law is the same, and in addition a seeded request's tokens are the very tokens it gets
without drafts, whatever was proposed or how many.

Random numbers are the sampler's counter-based uniforms u(seed, position, index, purpose): the
acceptance test of the draft for position t uses (t, 0, PURPOSE_ACCEPT), the residual draw at t uses
(t, token, PURPOSE_RESIDUAL), the bonus draw (t, token, PURPOSE_SAMPLE) as plain sampling does. A
position's token is decided once; uniforms of positions after a rejection were never used in a way that
reaches the output, so a later round may draw them again without bias.

Everything here is device tensor work with no host synchronisation and no data-dependent shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.kernels.sampling_reference import (PURPOSE_ACCEPT, PURPOSE_RESIDUAL, PURPOSE_SAMPLE, philox4x32)

_MASK32 = 0xFFFFFFFF
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Verdict:
    """Per row: `tokens[i, :counts[i]]` are its new tokens (accepted drafts, then one drawn)."""

    tokens: torch.Tensor        # [R, 1 + K] int64; entries at and after counts[i] are meaningless
    counts: torch.Tensor        # [R] int64, 1 .. 1 + num_drafts[i]

    @property
    def last_tokens(self) -> torch.Tensor:
        """[R]: each row's final token (the one the next step feeds)."""
        return self.tokens.gather(1, (self.counts - 1)[:, None])[:, 0]


def accept_drafts(target_probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                  seed_lo: torch.Tensor, seed_hi: torch.Tensor, first_positions: torch.Tensor,
                  draft_probs: torch.Tensor | None = None) -> Verdict:
    """target_probs [R, 1 + K, V] float32; drafts [R, K] int64 (row i uses its first num_drafts[i]);
    seeds [R] (the sampler table's two words); first_positions [R]: the token index of each row's first
    new token; draft_probs [R, K, V] (None: the drafts are point masses)."""
    rows, width, vocab_size = target_probs.shape
    depth = width - 1
    device = target_probs.device
    seed_lo, seed_hi = seed_lo.reshape(rows, 1), seed_hi.reshape(rows, 1)
    offsets = torch.arange(depth, device=device)
    p_draft = target_probs[:, :depth].gather(2, drafts[..., None])[..., 0]
    q_draft = 1.0 if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
    u = uniforms(seed_lo, seed_hi, first_positions[:, None] + offsets, torch.zeros_like(offsets), PURPOSE_ACCEPT)
    accepted = (offsets < num_drafts[:, None]) & (u * q_draft < p_draft)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    row_index = torch.arange(rows, device=device)
    p_next = target_probs[row_index, num_accepted]
    rejected = num_accepted < num_drafts
    final = torch.where(rejected[:, None], _residual(p_next, drafts, draft_probs, num_accepted), p_next)
    purposes = torch.where(rejected, PURPOSE_RESIDUAL, PURPOSE_SAMPLE)
    positions = (first_positions + num_accepted)[:, None]
    tokens_u = uniforms(seed_lo, seed_hi, positions, torch.arange(vocab_size, device=device), purposes[:, None])
    drawn = (final.double() / -torch.log(tokens_u)).argmax(dim=1)         # the exponential race
    tokens = torch.cat([drafts, drafts.new_zeros(rows, 1)], dim=1)
    tokens[row_index, num_accepted] = drawn
    return Verdict(tokens, num_accepted + 1)


def accept_matching(sampled: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> Verdict:
    """sampled [R, 1 + K]: the target's sample at each position (`DeviceSampler.sample`); drafts [R, K]
    point masses. The drafts are accepted while each equals the sample at its position."""
    depth = drafts.shape[1]
    offsets = torch.arange(depth, device=drafts.device)
    matches = (offsets < num_drafts[:, None]) & (drafts == sampled[:, :depth])
    return Verdict(sampled, matches.long().cumprod(dim=1).sum(dim=1) + 1)


def _residual(p_next: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
              num_accepted: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) at each row's first rejected position (unnormalised: the race needs no sum); p itself
    where that leaves nothing (p == q up to rounding: a rejection then is rounding's, not the test's)."""
    rows = p_next.shape[0]
    depth = drafts.shape[1]
    at = num_accepted.clamp(max=max(depth - 1, 0))
    if depth == 0:
        return p_next
    rejected_draft = drafts.gather(1, at[:, None])
    if draft_probs is None:
        residual = p_next.scatter(1, rejected_draft, 0.0)
    else:
        q_next = draft_probs[torch.arange(rows, device=p_next.device), at]
        residual = (p_next - q_next).clamp_min(0.0)
    empty = residual.sum(dim=1, keepdim=True) <= _TINY
    return torch.where(empty, p_next, residual)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, indices: torch.Tensor,
             purpose) -> torch.Tensor:
    """float64 uniforms in (0, 1), broadcast: the sampler's `counter_uniform(seed, position, index,
    purpose)` (flare.kernels.sampling_reference), with `purpose` an int or a tensor of them."""
    positions = positions.to(torch.int64)
    purpose = torch.as_tensor(purpose, dtype=torch.int64, device=positions.device)
    w0, w1, _, _ = philox4x32((indices, positions & _MASK32, positions >> 32, purpose), (seed_lo, seed_hi))
    bits52 = (w0 << 20) | (w1 >> 12)
    return (bits52.double() + 0.5) * 2.0 ** -52
