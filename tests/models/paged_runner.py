"""A tiny stand-in for the engine's runner: keeps sequences' pages and runs steps through the paged cache."""

from __future__ import annotations

import random

import torch

from flare.engine.attention import AttentionMetadata, allocate_kv_caches


class PagedRunner:
    """Runs steps of several sequences; pages are handed out in a shuffled order so none are contiguous."""

    def __init__(self, cfg, model, page_size: int = 4, num_pages: int = 96, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.model, self.page_size, self.device = model, page_size, device
        self.kv_caches = allocate_kv_caches(cfg, num_pages, page_size, dtype, device)
        self.free_pages = list(range(num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.pages: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Feed each named sequence its new tokens in one flattened batch; float32 logits `[new, V]` per sequence
        (on the runner's device)."""
        names = list(new_tokens)
        for name in names:
            self._grow(name, self.lengths.get(name, 0) + len(new_tokens[name]))
        meta = AttentionMetadata.build(
            query_lens=[len(new_tokens[name]) for name in names],
            seq_lens=[self.lengths[name] for name in names],
            page_tables=[self.pages[name] for name in names],
            page_size=self.page_size,
            device=self.device,
        )
        input_ids = torch.tensor([token for name in names for token in new_tokens[name]], device=self.device)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(input_ids, meta.positions(), self.kv_caches, meta))
        return dict(zip(names, logits.split([len(new_tokens[name]) for name in names]), strict=True))

    def greedy(self, name: str, prompt: list[int], max_new_tokens: int, chunks=None, stop_ids=()) -> list[int]:
        """Prefill `prompt` (in `chunks` if given), then decode token by token, always taking the argmax."""
        sizes = chunks or [len(prompt)]
        start = 0
        for size in sizes:
            logits = self.step({name: prompt[start : start + size]})[name]
            start += size
        generated = [int(logits[-1].argmax())]
        while len(generated) < max_new_tokens and generated[-1] not in stop_ids:
            generated.append(int(self.step({name: generated[-1:]})[name][-1].argmax()))
        return generated

    def _grow(self, name: str, length: int) -> None:
        pages = self.pages.setdefault(name, [])
        while len(pages) * self.page_size < length:
            pages.append(self.free_pages.pop())
        self.lengths[name] = length
