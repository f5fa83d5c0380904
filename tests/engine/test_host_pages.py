"""The host tier's page copies are generic over cache formats: any page-major views, of any dtype and page
shape, move page by page between the GPU's pages and host slots and back unchanged; a view whose first
dimension is not the allocator's pages is refused before anything is copied."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flare.engine.attention import allocate_kv_caches, kv_page_views
from flare.engine.retention.host_pages import HostPages, check_page_views, page_bytes, page_layout
from flare.engine.step import PageCopy

PAGES = 9
LATENT = SimpleNamespace(mla=SimpleNamespace(latent_dim=576))     # DeepSeek V2/V3's row: 512 + 64


def caches() -> list[torch.Tensor]:
    """Three formats on the same pages: a K/V cache `[2, pages, 4, 2, 8]` (bf16), a latent cache of one
    576-value row per token `[pages, 4, 576]` (fp16) and an odd-sized uint8 cache `[pages, 3, 7]`."""
    torch.manual_seed(0)
    kv = torch.randn(2, PAGES, 4, 2, 8).to(torch.bfloat16)
    latent = torch.randn(PAGES, 4, 576).to(torch.float16)
    odd = torch.randint(0, 255, (PAGES, 3, 7), dtype=torch.uint8)
    return [*kv_page_views(SimpleNamespace(mla=None), [kv]), *kv_page_views(LATENT, [latent]), odd]


def test_pages_of_every_format_go_to_the_host_and_come_back_unchanged():
    views = caches()
    original = [view.clone() for view in views]
    host = HostPages(views, num_slots=4)
    assert host.slot_bytes == page_bytes(views) == 2 * 4 * 2 * 8 * 2 + 4 * 576 * 2 + 3 * 7
    host.save([PageCopy(page=7, slot=1), PageCopy(page=2, slot=2), PageCopy(page=5, slot=0)])
    for view in views:
        view.zero_()
    host.load([PageCopy(page=3, slot=1), PageCopy(page=4, slot=2), PageCopy(page=8, slot=0)])
    for view, before in zip(views, original):
        assert torch.equal(view[3], before[7]) and torch.equal(view[4], before[2]) and torch.equal(view[8], before[5])
        assert not view[0].any()                            # nothing else was written
    parts = host.slot_parts(1)
    assert [len(part) for part in parts] == [256, 4608, 21]
    assert bytes(parts[2]) == original[2][7].flatten().numpy().tobytes()


def test_the_layout_names_every_tensor_s_dtype_and_page_shape():
    assert page_layout(caches()) == "bfloat16[2,4,2,8];float16[4,576];uint8[3,7]"


def test_a_view_not_indexed_by_pages_is_refused():
    latent = torch.zeros(PAGES, 4, 576)
    with pytest.raises(ValueError, match="cache tensor 0 .* 4 pages on its first dimension, the allocator has 9"):
        check_page_views([latent.movedim(1, 0)], PAGES)        # a latent cache seen as a K/V one
    check_page_views([latent, torch.zeros(2, PAGES, 4, 1, 8).movedim(1, 0)], PAGES)


@pytest.mark.parametrize("mla", [None, LATENT.mla], ids=["kv", "latent"])
@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_kv_page_views_cover_every_format_allocate_kv_caches_makes(mla, dtype):
    config = SimpleNamespace(kv_cache_dtype=dtype, num_key_value_heads=2, head_dim=8, num_hidden_layers=2, mla=mla)
    check_page_views(kv_page_views(config, allocate_kv_caches(config, PAGES, 4, torch.float32, "cpu")), PAGES)
