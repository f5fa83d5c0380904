"""The device sampler's Triton kernels against their torch reference, and its counter-based random numbers.

Both paths run through DeviceSampler (the same tables, written by `add`); the kernels run compiled on a
GPU or in Triton's interpreter here, so the shapes are small and the kernels' tiles smaller still.
"""

from __future__ import annotations

import math

import pytest
import torch

from flare.engine.sampler import DeviceSampler
from flare.engine.sampling_params import SamplingParams
from flare.kernels import sampling_reference as reference

VOCAB = 96
# Tiles of 32 tokens, 64 tokens per program: a row spans 2 programs, the second with one tile in range.
SMALL = dict(chunk=64, block=32, candidate_min_rows=1)     # the candidate path at every batch size

# (counter words, key words) -> output words: Random123's tests/kat_vectors, philox4x32 10.
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

PARAMETER_SETS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.6, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.02, top_k=40, top_p=0.5),
    SamplingParams(temperature=0.9, top_p=0.3, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=-0.5, logit_bias=((3, 4.0), (95, -2.0))),
    SamplingParams(temperature=1.1, top_k=1000, logit_bias=((0, 5.0), (64, 3.0), (65, 3.0), (127, 8.0))),
    SamplingParams(temperature=0.5, top_k=3, top_p=0.99, min_p=0.3, presence_penalty=-1.0),
    SamplingParams(temperature=2.0, top_p=0.999, seed=12345678901234567890 % 2 ** 64),
]


def samplers(num_slots: int, device) -> tuple[DeviceSampler, DeviceSampler]:
    from flare.kernels.sampling import SamplingKernelConfig

    kernel = DeviceSampler(num_slots, VOCAB, device, seed=3, use_triton=True,
                           kernel_config=SamplingKernelConfig(**SMALL))
    return kernel, DeviceSampler(num_slots, VOCAB, device, seed=3, use_triton=False)


def fill(sampler_pair, params_list, generator):
    for slot, params in enumerate(params_list):
        prompt = torch.randint(0, VOCAB, (12,), generator=generator).tolist()
        output = torch.randint(0, VOCAB, (6,), generator=generator).tolist()
        for sampler in sampler_pair:
            sampler.add(slot, params, prompt, output)


def batch_logits(rows: int, generator, device="cpu") -> torch.Tensor:
    """Half the rows continuous, half on a coarse grid: many exact ties, also at the thresholds."""
    logits = torch.randn(rows, VOCAB, generator=generator) * 3
    logits[1::2] = (logits[1::2] * 2).round() / 2
    return logits.to(device)


def test_philox_matches_random123_known_answers():
    for counter, key, expected in PHILOX_KNOWN_ANSWERS:
        words = reference.philox4x32([torch.tensor(c) for c in counter], [torch.tensor(k) for k in key])
        assert tuple(int(w) for w in words) == expected


def test_kernel_uniforms_are_the_reference_uniforms(kernel_device):
    from flare.kernels.sampling import uniforms

    seed_lo = torch.tensor([5, -7, 123456789, 0], dtype=torch.int32, device=kernel_device)
    seed_hi = torch.tensor([0, -1, 99, -2 ** 31], dtype=torch.int32, device=kernel_device)
    positions = torch.tensor([0, 2 ** 33 + 5, 77, 1], device=kernel_device)
    for purpose in (reference.PURPOSE_SAMPLE, reference.PURPOSE_ACCEPT, reference.PURPOSE_RESIDUAL):
        kernel = uniforms(seed_lo, seed_hi, positions, 300, purpose)
        expected = reference.counter_uniform(seed_lo[:, None], seed_hi[:, None], positions[:, None],
                                             torch.arange(300, device=kernel_device)[None, :], purpose)
        assert torch.equal(kernel, expected)
        assert 0 < kernel.min() and kernel.max() < 1
    streams = [reference.counter_uniform(seed_lo[:1, None], seed_hi[:1, None], positions[:1, None],
                                         torch.arange(300, device=kernel_device)[None, :], purpose)
               for purpose in range(3)]
    assert not torch.equal(streams[0], streams[1]) and not torch.equal(streams[1], streams[2])


@pytest.mark.parametrize("dtype,steps,params_list", [(torch.float32, 2, PARAMETER_SETS),
                                                      (torch.float16, 1, PARAMETER_SETS[:6])])
def test_kernel_samples_what_the_reference_samples(kernel_device, dtype, steps, params_list):
    generator = torch.Generator().manual_seed(0)
    pair = samplers(len(params_list), kernel_device)
    fill(pair, params_list, generator)
    rows = len(params_list)
    slots = torch.arange(rows, device=kernel_device)
    for step in range(steps):
        logits = batch_logits(rows, generator, kernel_device).to(dtype)
        positions = torch.randint(0, 10_000, (rows,), generator=generator).to(kernel_device)
        kernel_tokens, torch_tokens = (sampler.sample(logits, slots, positions) for sampler in pair)
        assert kernel_tokens.tolist() == torch_tokens.tolist()
        assert torch.equal(pair[0].tables.output_counts, pair[1].tables.output_counts)


# The candidate list's size: every row that can use it (the default), a few rows (8), none (0: radix only).
@pytest.mark.parametrize("candidates", [1024, 8, 0])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_both_paths_sample_what_the_reference_samples_at_any_batch(kernel_device, candidates, rows):
    """Rows through the candidate list and rows through the radix passes, side by side in batches of one
    to 40 rows (more rows than a row has parts), draw the reference's tokens."""
    from flare.kernels.sampling import MODE_CANDIDATES, MODE_GREEDY, MODE_RADIX, SamplingKernelConfig

    generator = torch.Generator().manual_seed(rows)
    params_list = [PARAMETER_SETS[i % len(PARAMETER_SETS)] for i in range(rows)]
    kernel = DeviceSampler(rows, VOCAB, kernel_device, seed=3, use_triton=True,
                           kernel_config=SamplingKernelConfig(**SMALL, candidates=candidates))
    pair = (kernel, DeviceSampler(rows, VOCAB, kernel_device, seed=3, use_triton=False))
    fill(pair, params_list, generator)
    slots = torch.randperm(rows, generator=generator).to(kernel_device)
    logits = batch_logits(rows, generator, kernel_device)
    positions = torch.randint(0, 10_000, (rows,), generator=generator).to(kernel_device)
    kernel_tokens, torch_tokens = (sampler.sample(logits, slots, positions) for sampler in pair)
    assert kernel_tokens.tolist() == torch_tokens.tolist()
    assert torch.equal(pair[0].tables.output_counts, pair[1].tables.output_counts)
    modes = kernel._workspace.row_mode[:rows].tolist()
    greedy = [params_list[int(slot)].temperature == 0 for slot in slots]
    assert [mode == MODE_GREEDY for mode in modes] == greedy
    radix = [mode == MODE_RADIX for mode in modes]
    uncut = [not is_greedy and p.top_p == 1.0 and not 0 < p.top_k < VOCAB and p.min_p == 0.0      # draws from all
             for p, is_greedy in ((params_list[int(slot)], g) for slot, g in zip(slots, greedy))]
    if candidates == 0:
        assert radix == [not is_greedy for is_greedy in greedy]
    elif candidates == 1024:                # every row with a cut fits the list
        assert radix == uncut
    else:
        assert all(r for r, u in zip(radix, uncut) if u)
        if rows >= len(PARAMETER_SETS):
            assert radix != uncut and MODE_CANDIDATES in modes


def test_candidate_rows_keep_the_reference_threshold_ties(kernel_device):
    """Coarse logits put whole tie groups at the top-k and top-p edges; the list keeps them all."""
    from flare.kernels.sampling import MODE_CANDIDATES, SamplingKernelConfig

    params_list = [SamplingParams(temperature=1.0, top_k=3, seed=1), SamplingParams(temperature=1.0, top_p=0.5, seed=2),
                   SamplingParams(temperature=0.7, top_k=4, top_p=0.6, seed=3)]
    rows = 3 * len(params_list)
    kernel = DeviceSampler(rows, VOCAB, kernel_device, seed=0, use_triton=True,
                           kernel_config=SamplingKernelConfig(**SMALL))
    pair = (kernel, DeviceSampler(rows, VOCAB, kernel_device, seed=0, use_triton=False))
    fill(pair, params_list * 3, torch.Generator().manual_seed(5))
    logits = torch.zeros(rows, VOCAB)
    logits[:, :12] = 2.0                                  # twelve tokens tied at the top
    logits[:, 40:50] = 1.0
    logits = logits.to(kernel_device)
    slots = torch.arange(rows, device=kernel_device)
    drawn = set()
    for step in range(4):
        positions = torch.full((rows,), step, device=kernel_device) + slots
        kernel_tokens, torch_tokens = (sampler.sample(logits, slots, positions) for sampler in pair)
        assert kernel_tokens.tolist() == torch_tokens.tolist()
        drawn.update(kernel_tokens.tolist())
        assert set(kernel._workspace.row_mode[:rows].tolist()) == {MODE_CANDIDATES}
    assert len(drawn & set(range(3, 12))) > 0          # tokens past the k-th, in its tie group, are drawn


def test_kernel_applies_the_allowed_token_mask_like_the_reference(kernel_device):
    generator = torch.Generator().manual_seed(1)
    params_list = PARAMETER_SETS[:8]
    pair = samplers(len(params_list), kernel_device)
    fill(pair, params_list, generator)
    rows = len(params_list)
    allowed = torch.rand(rows, VOCAB, generator=generator) < 0.3
    allowed[-1] = False                                   # a row that allows nothing gets the first index
    words = torch.stack([reference.pack_bits(row.nonzero()[:, 0].tolist(), VOCAB) for row in allowed])
    logits = batch_logits(rows, generator, kernel_device)
    positions = torch.arange(rows, device=kernel_device)
    kernel_tokens, torch_tokens = (sampler.sample(logits, torch.arange(rows, device=kernel_device), positions,
                                                  words.to(kernel_device)) for sampler in pair)
    assert kernel_tokens.tolist() == torch_tokens.tolist()
    assert all(allowed[row, token] for row, token in enumerate(kernel_tokens[:-1].tolist()))
    assert kernel_tokens[:-1].tolist() != [int(logits[row].argmax()) for row in range(rows - 1)]
    assert kernel_tokens[-1] == 0


def test_kernel_target_probs_match_the_reference(kernel_device):
    generator = torch.Generator().manual_seed(2)
    pair = samplers(len(PARAMETER_SETS), kernel_device)
    fill(pair, PARAMETER_SETS, generator)
    rows = len(PARAMETER_SETS)
    logits = batch_logits(rows, generator, kernel_device)
    kernel, expected = (sampler.target_probs(logits, torch.arange(rows, device=kernel_device)) for sampler in pair)
    assert torch.allclose(kernel, expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(kernel.sum(dim=1), torch.ones(rows, device=kernel_device), atol=1e-5)
    assert ((kernel > 0).sum(dim=1) > 1).sum() >= 6              # real cuts, not one-hots only


@pytest.mark.parametrize("candidates", [1024, 0])
def test_kernel_tokens_depend_only_on_the_request(kernel_device, candidates):
    """The same request gives the same tokens whatever else is in the batch and in whichever row it sits,
    on the candidate path and on the radix passes."""
    from flare.kernels.sampling import SamplingKernelConfig

    generator = torch.Generator().manual_seed(3)
    probe = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=99)
    others = PARAMETER_SETS[1:6]
    row_logits = batch_logits(1, generator)
    tokens = []
    for batch_size, row in ((1, 0), (5, 3)):
        sampler = DeviceSampler(8, VOCAB, kernel_device, seed=batch_size, use_triton=True,
                                kernel_config=SamplingKernelConfig(**SMALL, candidates=candidates))
        logits = batch_logits(batch_size, generator, kernel_device)
        logits[row] = row_logits[0]
        slots = []
        for i in range(batch_size):
            slot = (row + 3 + i) % 8
            sampler.add(slot, probe if i == row else others[i % len(others)], [1, 2, 3])
            slots.append(slot)
        positions = torch.randint(0, 50, (batch_size,), generator=generator)
        positions[row] = 17
        tokens.append(int(sampler.sample(logits, torch.tensor(slots, device=kernel_device),
                                         positions.to(kernel_device))[row]))
    assert len(set(tokens)) == 1


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("candidates", [1024, 0])
@pytest.mark.parametrize("vocab", [128256, 151936])
def test_full_vocabularies_match_the_reference_in_bfloat16(vocab, candidates):
    from flare.kernels.sampling import SamplingKernelConfig

    generator = torch.Generator().manual_seed(7)
    rows = 2 * len(PARAMETER_SETS)
    kernel = DeviceSampler(rows, vocab, "cuda", seed=1, use_triton=True,
                           kernel_config=SamplingKernelConfig(candidates=candidates, candidate_min_rows=1))
    torch_path = DeviceSampler(rows, vocab, "cuda", seed=1, use_triton=False)
    for slot, params in enumerate(PARAMETER_SETS * 2):
        prompt = torch.randint(0, vocab, (64,), generator=generator).tolist()
        for sampler in (kernel, torch_path):
            sampler.add(slot, params, prompt, prompt[:10])
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(torch.bfloat16).cuda()
    slots = torch.arange(rows, device="cuda")
    positions = torch.randint(0, 4096, (rows,), generator=generator).cuda()
    assert kernel.sample(logits, slots, positions).tolist() == torch_path.sample(logits, slots, positions).tolist()


@pytest.mark.gpu
@needs_cuda
def test_sampling_replays_in_a_cuda_graph():
    """Captured once, replayed over new logits and positions: the eager tokens and counts, every time."""
    vocab, rows = 32000, 8
    generator = torch.Generator().manual_seed(8)
    captured = DeviceSampler(rows, vocab, "cuda", seed=2, use_triton=True)
    eager = DeviceSampler(rows, vocab, "cuda", seed=2, use_triton=True)
    for slot, params in enumerate(PARAMETER_SETS[:rows]):
        for sampler in (captured, eager):
            sampler.add(slot, params, [1, 2, 3], [4])
    logits = torch.randn(rows, vocab, device="cuda")
    slots = torch.arange(rows, device="cuda")
    positions = torch.zeros(rows, dtype=torch.int64, device="cuda")
    captured.sample(logits, slots, positions)                   # compile outside the capture
    eager.sample(logits, slots, positions)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = captured.sample(logits, slots, positions)
    for step in range(4):
        logits.copy_(torch.randn(rows, vocab, generator=generator).cuda() * 3)
        positions.fill_(10 + step)
        graph.replay()
        assert tokens.tolist() == eager.sample(logits, slots, positions).tolist()
        assert torch.equal(captured.tables.output_counts, eager.tables.output_counts)


def test_batches_below_the_candidate_threshold_take_the_radix_passes(kernel_device):
    from flare.kernels.sampling import MODE_CANDIDATES, MODE_RADIX, SamplingKernelConfig

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    results = {}
    for rows in (2, 4):
        sampler = DeviceSampler(rows, 256, kernel_device, seed=1, use_triton=True,
                                kernel_config=SamplingKernelConfig(chunk=64, block=32, candidate_min_rows=4))
        for slot in range(rows):
            sampler.add(slot, params, [1, 2, 3], [])
        logits = torch.zeros(rows, 256, device=kernel_device)
        logits[:, 7] = 20.0                                    # one token holds the mass: a candidate row
        slots = torch.arange(rows, device=kernel_device)
        sampler.sample(logits, slots, torch.full_like(slots, 3))
        results[rows] = set(sampler._workspace.row_mode[:rows].tolist())
    assert results == {2: {MODE_RADIX}, 4: {MODE_CANDIDATES}}
    with pytest.raises(ValueError, match="candidate_min_rows must be 1 or more"):
        SamplingKernelConfig(candidate_min_rows=0)
