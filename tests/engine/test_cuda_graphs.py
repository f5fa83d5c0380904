"""Decode graphs: the catalog, bucket choice, padding into the dummy slot, and the same tokens as the
eager path. On a CPU the static-buffer path runs eagerly (capture=False); on a GPU it is captured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine.batch_slots import BatchSlots
from flare.engine.cuda_graphs import DecodeGraphs, bucket_for
from flare.engine.factory import load_checkpoint_model
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.runner import ModelRunner
from flare.engine.sampler import DeviceSampler
from flare.engine.sampling_params import SamplingParams
from flare.engine.step import NewRequest, ScheduledRow, StepPlan
from flare.engine.step_inputs import decode_rows
from flare.frontend.tokenizer import load_tokenizer
from flare.recipes.base import DECODE_CAPACITIES, decode_capacities_for
from tiny_checkpoints import write_tiny_checkpoint

CONFIG = EngineConfig(max_concurrency=6, page_size=16, num_pages=64, max_model_len=256, prefill_chunk=8,
                      max_num_batched_tokens=32)
PROMPTS = ["Once upon a time", "Tom had a", "The sun was", "Lily"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def engine(directory, device="cpu", dtype="float32", config=CONFIG, compiled=False, **runner_options) -> LLMEngine:
    loaded = load_checkpoint_model(directory, config, device, dtype)
    if compiled:
        from flare.engine.compile import compile_model

        compile_model(loaded.model)
    runner = ModelRunner(loaded.model, loaded.model_config, config, device, getattr(torch, dtype), seed=0,
                         **runner_options)
    return LLMEngine(EngineCore(config, runner, loaded.eos_token_ids), load_tokenizer(directory))


def test_bucket_is_the_smallest_captured_size_that_holds_the_batch():
    sizes = decode_capacities_for(DECODE_CAPACITIES, 64)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 40, 64]
    assert bucket_for(65, sizes) is None


def test_padded_rows_write_only_the_dummy_slot(stories260k):
    loaded = load_checkpoint_model(stories260k, CONFIG)
    from flare.engine.attention import allocate_kv_caches

    page_size, pages = CONFIG.page_size, CONFIG.num_pages
    caches = allocate_kv_caches(loaded.model_config, pages + 1, page_size, torch.float32, "cpu")
    for cache in caches:
        cache.fill_(7.0)
    dummy = pages * page_size
    sampler = DeviceSampler(2, loaded.model_config.vocab_size, "cpu", seed=0)
    slots = BatchSlots(max_slots=2, max_pages=4, dummy_page=pages, device=torch.device("cpu"), sampler=sampler)
    graphs = DecodeGraphs(loaded.model, caches, (4,), slots, page_size=page_size, max_seq_len=64, capture=False)
    plan = StepPlan((ScheduledRow("r", 1, 0, 1, new_page_ids=(3,), samples=True),),
                    (NewRequest("r", 1, (5,), (), SamplingParams(temperature=0)),))
    slots.apply(plan)
    hidden, logits, token_ids = graphs.run(decode_rows(plan, slots))
    assert hidden.shape[0] == logits.shape[0] == token_ids.shape[0] == 1 and torch.isfinite(logits).all()
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist() == slots.last_sampled[1:2].tolist()
    for cache in caches:
        slots = cache.flatten(1, 2)                                 # [2, slots, heads, dim]
        written = (slots != 7.0).any(dim=-1).any(dim=-1).any(dim=0).nonzero().flatten().tolist()
        assert written == [3 * page_size, dummy]
    assert graphs.seq_lens.tolist() == [1, 0, 0, 0]                 # padded rows see no context


def test_a_batch_larger_than_the_catalog_is_refused(stories260k):
    loaded = load_checkpoint_model(stories260k, CONFIG)
    sampler = DeviceSampler(3, loaded.model_config.vocab_size, "cpu", seed=0)
    slots = BatchSlots(max_slots=3, max_pages=2, dummy_page=1, device=torch.device("cpu"), sampler=sampler)
    graphs = DecodeGraphs(loaded.model, [torch.zeros(2, 2, 16, 1, 8)], (1, 2), slots, page_size=16,
                          max_seq_len=32, capture=False)
    rows = np.array([[0, 1, 2], [0, 0, 0], [1, 2, 3]])          # slot, position, token id of three rows
    with pytest.raises(ValueError, match="exceeds the largest captured graph"):
        graphs.run(rows)


def test_static_buffer_path_gives_the_eager_tokens(stories260k, checked):
    eager = checked(engine(stories260k))
    padded = checked(engine(stories260k, graphs=True, capture=False))
    assert padded.core.runner.graphs is not None and eager.core.runner.graphs is None
    expected = [out.new_token_ids for out in eager.generate(PROMPTS[:3], GREEDY)]   # batch 3 -> bucket 4
    assert [out.new_token_ids for out in padded.generate(PROMPTS[:3], GREEDY)] == expected


def test_static_buffer_path_keeps_seeded_sampling_batch_invariant_and_logprobs(stories260k, checked):
    padded = checked(engine(stories260k, graphs=True, capture=False))
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=3, logprobs=2, prompt_logprobs=1)
    [alone] = padded.generate([PROMPTS[1]], seeded)
    crowd = padded.generate(PROMPTS, [GREEDY, seeded, SamplingParams(max_tokens=5, seed=1), GREEDY])
    assert crowd[1].new_token_ids == alone.new_token_ids
    eager = checked(engine(stories260k))
    [reference] = eager.generate([PROMPTS[1]], seeded)
    assert reference.new_token_ids == alone.new_token_ids
    assert [lp.logprob for lp in reference.new_logprobs] == pytest.approx(
        [lp.logprob for lp in alone.new_logprobs], abs=1e-4)
    assert len(alone.new_logprobs) == 16 and alone.prompt_logprobs == reference.prompt_logprobs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random Llama with 16-wide heads: the Triton kernels' smallest (stories260k's are 8 wide)."""
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:3]], ids=["full bucket", "padded bucket"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_give_the_eager_greedy_tokens_on_the_gpu(tiny_llama, checked, dtype, prompts):
    eager = checked(engine(tiny_llama, "cuda", dtype, graphs=False))
    graphed = checked(engine(tiny_llama, "cuda", dtype))
    assert graphed.core.runner.graphs.graphs, "no graph was captured"
    expected = [out.new_token_ids for out in eager.generate(prompts, GREEDY)]
    assert [out.new_token_ids for out in graphed.generate(prompts, GREEDY)] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_layers_in_captured_graphs_give_the_eager_greedy_tokens(tiny_llama, checked):
    eager = checked(engine(tiny_llama, "cuda", "float32", graphs=False))
    compiled = checked(engine(tiny_llama, "cuda", "float32", compiled=True))
    expected = [out.new_token_ids for out in eager.generate(PROMPTS[:3], GREEDY)]
    assert [out.new_token_ids for out in compiled.generate(PROMPTS[:3], GREEDY)] == expected


MIXED_SAMPLING = [GREEDY,
                  SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0.6, top_k=20, seed=6, max_tokens=24, ignore_eos=True,
                                 repetition_penalty=1.2, frequency_penalty=0.3, logit_bias=((7, 2.0),)),
                  SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5, logprobs=0)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_inside_the_captured_graph_gives_the_eager_runner_s_tokens(tiny_llama, checked, dtype):
    """The device sampler runs inside the decode graph (greedy, top-p, top-k, penalties, bias, seeds) and
    in the eager runner; both give the same tokens and logprobs."""
    eager = checked(engine(tiny_llama, "cuda", dtype, graphs=False))
    graphed = checked(engine(tiny_llama, "cuda", dtype))
    assert graphed.core.runner.graphs.graphs, "no graph was captured"
    expected = eager.generate(PROMPTS, MIXED_SAMPLING)
    outputs = graphed.generate(PROMPTS, MIXED_SAMPLING)
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in expected]
    for mine, theirs in zip(outputs, expected):
        assert [e.logprob for e in mine.new_logprobs] == pytest.approx([e.logprob for e in theirs.new_logprobs],
                                                                        abs=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_sampling_in_the_captured_graph_is_batch_invariant(tiny_llama, checked):
    graphed = checked(engine(tiny_llama, "cuda", "float32"))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=24, ignore_eos=True)
    [alone] = graphed.generate([PROMPTS[1]], seeded)
    crowd = graphed.generate(PROMPTS, [MIXED_SAMPLING[1], seeded, MIXED_SAMPLING[2], GREEDY])
    assert crowd[1].new_token_ids == alone.new_token_ids
    [again] = checked(engine(tiny_llama, "cuda", "float32")).generate([PROMPTS[1]], seeded)
    assert again.new_token_ids == alone.new_token_ids


def packed_bitmask(allowed: np.ndarray) -> np.ndarray:
    """int32 [rows, ceil(V / 32)] with bit t % 32 of word t // 32 set where `allowed[row, t]` (xgrammar's layout)."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    bits = np.zeros((rows, words * 32), dtype=np.uint64)
    bits[:, :vocab] = allowed
    packed = (bits.reshape(rows, words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=-1)
    return packed.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_graphs_with_masks_between_them_replay_the_eager_halves(tiny_llama, dtype):
    """The forward graph, then masks copied in, then the sampling graph: the same logits and ids (greedy and
    seeded rows, every id one its mask allows) as the two halves run eagerly on the same static buffers."""
    loaded = load_checkpoint_model(tiny_llama, CONFIG, "cuda", dtype)
    runner = ModelRunner(loaded.model, loaded.model_config, CONFIG, "cuda", getattr(torch, dtype), seed=0)
    graphs = runner.graphs
    assert graphs.graphs, "no graph was captured"
    prompts = [[1, 5, 9], [1, 7], [1, 11, 13, 17]]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0)]
    new = tuple(NewRequest(f"r{i}", i, tuple(p), (), sp) for i, (p, sp) in enumerate(zip(prompts, params)))
    rows = tuple(ScheduledRow(f"r{i}", i, 0, len(p), new_page_ids=(i,), samples=True) for i, p in enumerate(prompts))
    runner.launch(StepPlan(rows, new)).result()
    # One decode row each, with host ids: the step writes the same K/V however often it runs.
    table = np.array([[0, 1, 2], [len(p) for p in prompts], [21, 22, 23]], dtype=np.int64)
    allowed = np.random.default_rng(0).random((3, runner.vocab_size)) < 0.3
    bitmask = packed_bitmask(allowed)
    launch = graphs.launch_forward(table)
    _, logits, token_ids = (t.clone() for t in graphs.sample(launch, bitmask))
    graphs.capture = False
    try:
        _, eager_logits, eager_ids = graphs.run(table, bitmask)
    finally:
        graphs.capture = True
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    torch.testing.assert_close(logits, eager_logits, atol=tolerance, rtol=tolerance)
    assert token_ids.tolist() == eager_ids.tolist()
    assert all(allowed[i, t] for i, t in enumerate(token_ids.tolist()))
    for i in (0, 2):                                                # greedy: the best token the mask allows
        best = eager_logits[i].masked_fill(~torch.from_numpy(allowed[i]).cuda(), float("-inf")).max()
        assert eager_logits[i, token_ids[i]] == best
    _, _, free_ids = graphs.run(table)                              # no masks: the masked rows allow all again
    assert bool((graphs.bitmask == -1).all()) and free_ids.shape == (3,)
