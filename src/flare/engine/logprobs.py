"""Token logprobs in two halves: selected on the device when a step is launched, read on the host when
its result is. Between the two nothing waits, so a step can be launched before the last one is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flare.engine.outputs import TokenLogprob


@dataclass(frozen=True)
class SelectedLogprobs:
    """For row i: token_ids[i], its logprob and rank, and the `most` best alternatives of the row."""

    token_ids: torch.Tensor             # [n] int64
    chosen: torch.Tensor                # [n] float32
    ranks: torch.Tensor                 # [n] int64, 1 = the most likely token
    top_values: torch.Tensor | None     # [n, most]
    top_ids: torch.Tensor | None        # [n, most]

    def to_host(self) -> SelectedLogprobs:
        """Copies on their way to host memory; valid once the device has run them."""
        def host(tensor):
            return None if tensor is None else tensor.to("cpu", non_blocking=True)
        return SelectedLogprobs(host(self.token_ids), host(self.chosen), host(self.ranks), host(self.top_values),
                                host(self.top_ids))

    def entries(self, num_top: Sequence[int]) -> list[TokenLogprob]:
        """Row i with its num_top[i] best alternatives (reads the tensors: call on host copies)."""
        token_ids, chosen, ranks = self.token_ids.tolist(), self.chosen.tolist(), self.ranks.tolist()
        top_values = self.top_values.tolist() if self.top_values is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        entries = []
        for i, token_id in enumerate(token_ids):
            top = tuple(zip(top_ids[i][:num_top[i]], top_values[i][:num_top[i]])) if top_ids is not None else ()
            entries.append(TokenLogprob(token_id, chosen[i], ranks[i], top))
        return entries


def select_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, most: int) -> SelectedLogprobs:
    """logprobs [n, V] (log-softmax), token_ids [n]: the device half."""
    chosen = logprobs.gather(-1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (None, None)
    return SelectedLogprobs(token_ids, chosen[:, 0], ranks, top_values, top_ids)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprob]:
    """For row i: the logprob and rank of token_ids[i], plus the num_top[i] best alternatives (both halves)."""
    return select_logprobs(logprobs, token_ids, max(num_top, default=0)).entries(num_top)
