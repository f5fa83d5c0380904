"""A stand-in for the engine's runner over a cache with window pages (DeepSeek V4): tokens pages for every
block of a sequence, window pages only for the blocks its next step reads (flare.models.cache_spec). Pages
are handed out shuffled, and a window page given back is filled with garbage before anyone gets it again,
so a step that read below its window would show it."""

from __future__ import annotations

import random

import torch

from flare.engine.attention import AttentionMetadata
from flare.engine.layer_cache import allocate_layer_caches
from flare.models.cache_spec import cache_spec

GARBAGE = 1e4


class WindowPagedRunner:
    def __init__(self, cfg, model, page_size: int = 8, num_pages: int = 64, num_window_pages: int = 64,
                 seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.model, self.page_size, self.device = model, page_size, device
        self.spec = cache_spec(cfg, page_size, torch.finfo(dtype).bits // 8)
        self.caches = allocate_layer_caches(self.spec, cfg.num_hidden_layers, num_pages, num_window_pages, dtype,
                                            device)
        shuffle = random.Random(seed)
        self.free_pages = list(range(num_pages))
        self.free_window = list(range(num_window_pages))
        shuffle.shuffle(self.free_pages)
        shuffle.shuffle(self.free_window)
        self.pages: dict[str, list[int]] = {}
        self.window: dict[str, list[int | None]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Feed each named sequence its new tokens in one flattened batch; float32 logits [new, V] each."""
        names = list(new_tokens)
        for name in names:
            self._grow(name, self.lengths.get(name, 0), len(new_tokens[name]))
        meta = AttentionMetadata.build(
            query_lens=[len(new_tokens[name]) for name in names],
            seq_lens=[self.lengths[name] for name in names],
            page_tables=[self.pages[name] for name in names],
            page_size=self.page_size, device=self.device,
            window_page_tables=[[page if page is not None else 0 for page in self.window[name]] for name in names])
        input_ids = torch.tensor([token for name in names for token in new_tokens[name]], device=self.device)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(input_ids, meta.positions(), self.caches, meta))
        return dict(zip(names, logits.split([len(new_tokens[name]) for name in names]), strict=True))

    def _grow(self, name: str, start: int, count: int) -> None:
        pages, window = self.pages.setdefault(name, []), self.window.setdefault(name, [])
        first = self.spec.window_blocks_before(start)
        for block in range(first):
            if window[block] is not None:
                self._give_back(window[block])
                window[block] = None
        while len(pages) * self.page_size < start + count:
            pages.append(self.free_pages.pop())
            window.append(self.free_window.pop())
        self.lengths[name] = start + count

    def _give_back(self, page: int) -> None:
        for cache in self.caches:
            for name, tensor in cache.tensors():
                if name in ("window_kv", "compressor_inputs", "indexer_inputs"):
                    tensor[page] = GARBAGE
        self.free_window.insert(0, page)
