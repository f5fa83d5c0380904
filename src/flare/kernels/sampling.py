"""Sampling on the device without sorting the vocabulary: capturable, exact, batch-invariant.

The semantics (penalties, bias, mask, greedy, min-p, top-k, top-p, the draw, ties) and the random
numbers are those of flare.kernels.sampling_reference, the torch reference these kernels are tested
against. Per-request parameters come from device tables indexed by slot (`SamplingTables`), so a step
builds nothing on the host and the whole call can be captured in a CUDA graph.

Every cut is a threshold on w (min-p on x, top-k and top-p on w), so a row keeps an upper set of its
tokens, and two paths find it:

The candidate path (rows that keep few tokens: a peaked distribution or a small top-k). A scan counts,
per part, the finite tokens at x >= -2, -4, ..., -16 (x = (w - max w) / temperature) and their min-p
mass. The highest level that must hold every token the row may keep -- at least k tokens for top-k, at least top_p of the
min-p mass for top-p, a level at or below the min-p cut otherwise -- and has at most `candidates`
tokens is compacted into the row's list, in token order. One program per row then finds the top-k
threshold (the largest value with k tokens at or above it) and the top-p threshold (the largest kept
value whose head holds top_p of the mass) by counting and summing over all pairs of the list, and runs
the race over the list alone: the work per token of the vocabulary is the prepare pass and the scan,
whatever the batch.

The radix passes (rows without a cut, or whose kept tokens do not fit the list). Every processed logit w
has a 32-bit key whose unsigned order is the float order. The k-th largest key (top-k) and the key where
the head's probability mass reaches top_p (top-p) are found by radix select, 4 bits a pass from the top:
a pass histograms the keys' next digit over the candidates that match the digits chosen so far (counts
for top-k, masses exp(x) for top-p), and the next pass picks the bin where the running count (mass) from
the top reaches k (top_p * mass); eight passes fix a key exactly. Then each kept token gets x + g with g
a Gumbel variate, and the largest wins (the exponential race: an exact draw from the renormalised kept
mass). Both paths draw with the same variates, so they give the same token up to float summation order.

Why 4 bits a pass: Triton has no weighted shared-memory histogram, so a pass costs a compare, a select
and an add per element per bin. 2^b bins and 32 / b passes cost 2^b * 32 / b per element: b = 8 gives
1024, b = 4 gives 128, b = 2 gives 64 but 16 launches per threshold. At batch 1 the launches dominate
(the 512 KB of fp32 logits sit in L2), at batch 256 the per-element work does; b = 4 balances the two.

Launches (grid rows x parts unless said; each part owns CHUNK consecutive tokens of its row):
    prepare w from the logits (penalties, bias, mask) into the workspace, each part's max and
            argmax, each tile's largest key, and for top-k rows the histogram of digit 0
    scan    the candidate levels' counts and masses
    compact the chosen level's tokens into the row's list
    select  one program per row: the row's mode (greedy, candidates, radix); for candidate rows the
            thresholds and the race
    1..16   radix passes, on a fixed grid that walks the (row, part) items of radix rows only (every
            program stops after one read of the modes when there are none). Each pass first decides
            the previous pass's digit from the parts' histograms (every part computes the same
            decision; part 0 records it), then does its own work for the row:
              top-k rows: digits 1..7 in passes 1..7
              top-p rows: digits 0..7 in passes 1..8, or 8..15 after a top-k
              the draw in the pass after the last digit (pass 1 for rows with neither)
    finish  one program per row: the token (the list's winner, the race's winner, or the argmax for
            greedy rows and rows that keep nothing), and one more output count for penalty slots
A radix row whose thresholds are known early does nothing in later passes; a tile whose largest key is
below the current bucket is skipped without being read. target_probs (speculation) takes the radix
passes for every random row.

Exactness: the prepare kernel rounds every operation as torch does (correctly rounded division, no
fused multiply-adds), so w, the keys, top-k and min-p match the reference bit for bit; masses and the
Gumbel variates go through exp/log, whose last bits differ between implementations, so kernel and
reference can disagree only where a threshold or the race is decided within a few ulps.

Determinism: counts are integers; masses are float32 sums in a fixed order (tiles of a part in turn,
then parts 0..P-1; the list's pairs block by block), and the split of a row into parts, the levels and
the list's size depend only on the vocabulary size and the config, never on the batch. So a row's path
and token depend only on its logits, its slot's parameters and its position.

Shapes:
    logits          [N, V] float32/bfloat16/float16, last dim contiguous
    slots           [N] int64 (device): each row's slot in the tables (rows may share a slot)
    positions       [N] int64 (device): each row's position (the counter of its random numbers)
    allowed_bitmask [N, ceil(V / 32)] int32 or None: bit t % 32 of word t // 32 set = token t allowed
    out             [N] int64
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flare.kernels.sampling_reference import (
    FIELD_FLAGS, FIELD_FREQUENCY, FIELD_INV_TEMPERATURE, FIELD_LOG_MIN_P, FIELD_NUM_BIAS, FIELD_PRESENCE,
    FIELD_REPETITION, FIELD_SEED_HI, FIELD_SEED_LO, FIELD_TOP_K, FIELD_TOP_P, FLAG_BIAS, FLAG_PENALTIES,
    FLAG_RANDOM, NUM_FIELDS, PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1,
    PURPOSE_SAMPLE, SamplingTables, bitmask_words)

NUM_PASSES = 17                 # prepare + 16 passes; the last top-p digit is decided in pass 16
HIST_PASSES = 16                # passes that may leave a histogram (0..15)
STATE_FIELDS = 8
LEVELS = 8                      # the candidate levels x >= -2, -4, ..., -16
LEVEL_STEP = 2.0
SCAN_FIELDS = 1 + 2 * LEVELS    # per part: min-p mass, then each level's count and min-p mass
MODE_GREEDY, MODE_CANDIDATES, MODE_RADIX = 0, 1, 2      # how a row was sampled (workspace.row_mode)

_F_FLAGS = tl.constexpr(FIELD_FLAGS)
_F_TOP_K = tl.constexpr(FIELD_TOP_K)
_F_TOP_P = tl.constexpr(FIELD_TOP_P)
_F_INV_T = tl.constexpr(FIELD_INV_TEMPERATURE)
_F_LOG_MIN_P = tl.constexpr(FIELD_LOG_MIN_P)
_F_REPETITION = tl.constexpr(FIELD_REPETITION)
_F_PRESENCE = tl.constexpr(FIELD_PRESENCE)
_F_FREQUENCY = tl.constexpr(FIELD_FREQUENCY)
_F_SEED_LO = tl.constexpr(FIELD_SEED_LO)
_F_SEED_HI = tl.constexpr(FIELD_SEED_HI)
_F_NUM_BIAS = tl.constexpr(FIELD_NUM_BIAS)
_NUM_FIELDS = tl.constexpr(NUM_FIELDS)
_RANDOM = tl.constexpr(FLAG_RANDOM)
_PENALTIES = tl.constexpr(FLAG_PENALTIES)
_BIAS = tl.constexpr(FLAG_BIAS)

_S_PREFIX = tl.constexpr(0)         # key bits chosen so far in the current threshold (uint32 bits)
_S_K_LEFT = tl.constexpr(1)         # top-k: tokens still to take inside the current bucket
_S_TAU_K = tl.constexpr(2)          # the top-k threshold key (0: none)
_S_TAU_P = tl.constexpr(3)          # the top-p threshold key (0: none)
_S_MASS_ABOVE = tl.constexpr(4)     # top-p: mass of the kept tokens above the current bucket (float bits)
_S_TARGET = tl.constexpr(5)         # top-p: top_p * the mass left by min-p and top-k (float bits)
_STATE_FIELDS = tl.constexpr(STATE_FIELDS)
_LEVEL_STEP = tl.constexpr(LEVEL_STEP)
_MODE_GREEDY = tl.constexpr(MODE_GREEDY)
_MODE_CANDIDATES = tl.constexpr(MODE_CANDIDATES)
_MODE_RADIX = tl.constexpr(MODE_RADIX)

_M0 = tl.constexpr(PHILOX_M0)
_M1 = tl.constexpr(PHILOX_M1)
_W0 = tl.constexpr(PHILOX_W0)
_W1 = tl.constexpr(PHILOX_W1)
_ROUNDS = tl.constexpr(PHILOX_ROUNDS)
_PURPOSE_SAMPLE = tl.constexpr(PURPOSE_SAMPLE)


@dataclass(frozen=True)
class SamplingKernelConfig:
    """Launch shape. `chunk` (tokens per program) fixes how a row's sums are split, so it must not change
    with the batch; results are identical for any config only up to float summation order.

    `candidates`: the most tokens a row's candidate list holds (0: every random row takes the radix
    passes); `candidate_min_rows`: batches of fewer rows take the radix passes too (on an H200, 128,256
    tokens, 2026-12-02: the list made 8 rows slower, 0.151 -> 0.184 ms with top-p, 0.158 -> 0.365 with
    penalties, and 64 rows 2.2x faster, 0.778 -> 0.359 ms; 256 rows 3.5x); `pair_block`: the side of the select kernel's pair tiles; `radix_programs`: the fixed grid of
    the radix passes, which walk the (row, part) items of the rows that need them."""

    chunk: int = 4096
    block: int = 1024
    num_warps: int = 4
    candidates: int = 1024
    candidate_min_rows: int = 32
    pair_block: int = 64
    radix_programs: int = 2048

    def __post_init__(self) -> None:
        for name in ("chunk", "block", "pair_block", "radix_programs"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"sampling: {name} must be a positive power of two, not {value}")
        if self.chunk % self.block:
            raise ValueError(f"sampling: chunk {self.chunk} must be a multiple of block {self.block}")
        if self.candidates < 0:
            raise ValueError(f"sampling: candidates must be 0 (off) or more, not {self.candidates}")
        if self.candidate_min_rows < 1:
            raise ValueError(f"sampling: candidate_min_rows must be 1 or more, not {self.candidate_min_rows}")

    def parts(self, vocab_size: int) -> int:
        return triton.cdiv(vocab_size, self.chunk)

    @property
    def scan_block(self) -> int:
        return min(self.block, 256)


@dataclass(frozen=True)
class SamplingWorkspace:
    """Scratch for up to `max_rows` rows, allocated once (static addresses for graph capture)."""

    logits: torch.Tensor            # [rows, V] float32: w
    stats_value: torch.Tensor       # [rows, parts] float32: each part's largest w
    stats_index: torch.Tensor       # [rows, parts] int32: and its first index
    tile_max: torch.Tensor          # [rows, parts * tiles] int32: each tile's largest key (uint32 bits)
    hist: torch.Tensor              # [HIST_PASSES, rows, parts, 16] float32
    state: torch.Tensor             # [NUM_PASSES, rows, STATE_FIELDS] int32
    race_value: torch.Tensor        # [rows, parts] float32: each part's best x + g
    race_index: torch.Tensor        # [rows, parts] int32
    kept_mass: torch.Tensor         # [rows, parts] float32 (target_probs only)
    scan: torch.Tensor              # [rows, parts, SCAN_FIELDS] float32: the candidate levels' counts and masses
    cand_value: torch.Tensor        # [rows, max(candidates, 1)] float32: a candidate row's tokens' w, in token order
    cand_index: torch.Tensor        # [rows, max(candidates, 1)] int32: and their ids
    row_mode: torch.Tensor          # [rows] int32: MODE_* of each row of the last call
    drawn: torch.Tensor             # [rows] int32: a candidate row's drawn token (V: it kept none)
    config: SamplingKernelConfig

    @staticmethod
    def allocate(max_rows: int, vocab_size: int, device: torch.device | str,
                 config: SamplingKernelConfig = SamplingKernelConfig()) -> SamplingWorkspace:
        parts = config.parts(vocab_size)
        capacity = max(config.candidates, 1)
        tiles = parts * (config.chunk // config.block)
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        return SamplingWorkspace(
            logits=torch.empty(max_rows, vocab_size, **f32), stats_value=torch.empty(max_rows, parts, **f32),
            stats_index=torch.empty(max_rows, parts, **i32), tile_max=torch.empty(max_rows, tiles, **i32),
            hist=torch.empty(HIST_PASSES, max_rows, parts, 16, **f32),
            state=torch.empty(NUM_PASSES, max_rows, STATE_FIELDS, **i32),
            race_value=torch.empty(max_rows, parts, **f32), race_index=torch.empty(max_rows, parts, **i32),
            kept_mass=torch.empty(max_rows, parts, **f32), scan=torch.empty(max_rows, parts, SCAN_FIELDS, **f32),
            cand_value=torch.empty(max_rows, capacity, **f32), cand_index=torch.empty(max_rows, capacity, **i32),
            row_mode=torch.zeros(max_rows, **i32), drawn=torch.empty(max_rows, **i32), config=config)

    @property
    def max_rows(self) -> int:
        return self.logits.shape[0]


# -- device helpers (few: under Triton's interpreter every helper call costs a language re-patch) --------

@triton.jit
def _choose_bin(hist, base, need):
    """The highest bin b with base + (sum of bins >= b) >= need (bin 0 if none), and the sum above b."""
    bins = tl.arange(0, 16)
    at_or_above = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0.0), axis=1)
    above = tl.sum(tl.where(bins[None, :] > bins[:, None], hist[None, :], 0.0), axis=1)
    chosen = tl.max(tl.where(base + at_or_above >= need, bins, 0), axis=0)
    return chosen, tl.sum(tl.where(bins == chosen, above, 0.0), axis=0)


@triton.jit
def counter_uniform(seed_lo, seed_hi, position, index, purpose):
    """float64 uniforms in (0, 1) for token indices `index` (a tensor): counter_uniform in
    sampling_reference, bit for bit. seed_lo/seed_hi are the seed's 32-bit words (int32 bits), position
    an integer scalar, purpose a PURPOSE_* constant. Other kernels (speculation) may call it."""
    pos = position.to(tl.int64)
    c0 = index.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (pos & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + (pos >> 32).to(tl.uint32)
    c3 = zero + purpose
    k0 = seed_lo.to(tl.uint32, bitcast=True)
    k1 = seed_hi.to(tl.uint32, bitcast=True)
    for _ in tl.static_range(_ROUNDS):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    bits52 = (c0.to(tl.uint64) << 20) | (c1 >> 12).to(tl.uint64)
    return (bits52.to(tl.float64) + 0.5) * 2.220446049250313e-16       # 2 ** -52


# A row's schedule follows from its parameters: its digit passes are [first, first + digits) -- top-k's
# 8 digits from pass 0, then top-p's 8 (from pass 1 when there is no top-k) -- and its draw is the pass
# right after them. State slot j of a row holds its thresholds after j digit decisions.

# -- pass 0: prepare --------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["slots_ptr"])
def _prepare_kernel(
    logits_ptr, stride_logits, w_ptr, stride_w, slots_ptr, params_ptr,
    prompt_bits_ptr, stride_bits, counts_ptr, stride_counts, bias_ids_ptr, bias_values_ptr,
    mask_ptr, stride_mask, stats_value_ptr, stats_index_ptr, tile_max_ptr, hist_ptr, state_ptr,
    V, max_rows,
    HAS_MASK: tl.constexpr, BIAS_WIDTH: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
):
    TILES: tl.constexpr = CHUNK // BLOCK
    row = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    params = params_ptr + slot * _NUM_FIELDS
    flags = tl.load(params + _F_FLAGS)
    top_k = tl.load(params + _F_TOP_K)
    has_k = ((flags & _RANDOM) != 0) & (top_k > 0)
    has_penalties = (flags & _PENALTIES) != 0
    has_bias = (flags & _BIAS) != 0
    repetition = tl.load(params + _F_REPETITION).to(tl.float32, bitcast=True)
    presence = tl.load(params + _F_PRESENCE).to(tl.float32, bitcast=True)
    frequency = tl.load(params + _F_FREQUENCY).to(tl.float32, bitcast=True)
    bias_ids = bias_ids_ptr + slot * BIAS_WIDTH
    best = tl.full([], float("-inf"), tl.float32)
    best_index = part * CHUNK
    hist = tl.zeros([16], dtype=tl.float32)
    bins = tl.arange(0, 16)
    for t in range(TILES):
        tile_start = part * CHUNK + t * BLOCK
        offs = tile_start + tl.arange(0, BLOCK)
        in_range = offs < V
        w = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + offs, mask=in_range,
                    other=float("-inf")).to(tl.float32)
        if has_penalties:           # repetition on prompt and output tokens, presence/frequency on output counts
            count = tl.load(counts_ptr + slot * stride_counts + offs, mask=in_range, other=0)
            word = tl.load(prompt_bits_ptr + slot * stride_bits + (offs >> 5), mask=in_range, other=0)
            seen = (((word >> (offs & 31)) & 1) != 0) | (count > 0)
            w = tl.where(seen, tl.where(w > 0, tl.math.div_rn(w, repetition), w * repetition), w)
            w = w - (frequency * count.to(tl.float32) + presence * (count > 0).to(tl.float32))
        if has_bias:                # the entries inside this tile: a run of the ascending ids
            ids = tl.load(bias_ids + tl.arange(0, BIAS_WIDTH))
            first_entry = tl.sum((ids < tile_start).to(tl.int32), axis=0)
            for entry in range(first_entry, tl.sum((ids < tile_start + BLOCK).to(tl.int32), axis=0)):
                bias = tl.load(bias_values_ptr + slot * BIAS_WIDTH + entry)
                w = tl.where(offs == tl.load(bias_ids + entry), w + bias, w)
        if HAS_MASK:
            word = tl.load(mask_ptr + row * stride_mask + (offs >> 5), mask=in_range, other=0)
            w = tl.where(((word >> (offs & 31)) & 1) != 0, w, float("-inf"))
        w = tl.where(in_range, tl.where(w == 0.0, 0.0, w), float("-inf"))      # -0.0 -> +0.0
        tl.store(w_ptr + row.to(tl.int64) * stride_w + offs, w, mask=in_range)
        bits = w.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)    # unsigned order = float order
        tl.store(tile_max_ptr + row * (PARTS * TILES) + part * TILES + t,
                 tl.max(tl.where(in_range, key, 0), axis=0).to(tl.int32, bitcast=True))
        tile_best = tl.max(w, axis=0)
        best_index = tl.where(tile_best > best, tile_start + tl.argmax(w, axis=0), best_index)
        best = tl.maximum(best, tile_best)
        if has_k:
            hit = in_range[:, None] & ((key >> 28).to(tl.int32)[:, None] == bins[None, :])
            hist += tl.sum(tl.where(hit, 1.0, 0.0), axis=0)
    tl.store(stats_value_ptr + row * PARTS + part, best)
    tl.store(stats_index_ptr + row * PARTS + part, best_index)
    if has_k:
        tl.store(hist_ptr + (row * PARTS + part) * 16 + bins, hist)
    if part == 0:                               # state slot 0: nothing chosen, k tokens to take
        st = state_ptr + row * _STATE_FIELDS
        tl.store(st + _S_PREFIX, 0)
        tl.store(st + _S_K_LEFT, top_k)
        tl.store(st + _S_TAU_K, 0)
        tl.store(st + _S_TAU_P, 0)
        tl.store(st + _S_MASS_ABOVE, 0)        # the bits of 0.0
        tl.store(st + _S_TARGET, 0)


# -- the candidate path: scan, compact, select ------------------------------------------------------------

@triton.jit
def _tile_max_value(tile_max_ptr, index):
    """The largest w of a tile, from its stored key (a tile with nothing in range reads as NaN)."""
    key = tl.load(tile_max_ptr + index)                 # int32 bits: negative where the float is >= +0
    bits = tl.where(key < 0, key & 0x7FFFFFFF, ~key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["slots_ptr"])
def _scan_kernel(
    w_ptr, stride_w, slots_ptr, params_ptr, stats_value_ptr, scan_ptr, V,
    CHUNK: tl.constexpr, SCAN_BLOCK: tl.constexpr, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """Each part's min-p mass of its random row and, per level e, the count of finite tokens with x >= e
    and their min-p mass: [mass, counts[LEVELS], masses[LEVELS]]."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    params = params_ptr + tl.load(slots_ptr + row) * _NUM_FIELDS
    if (tl.load(params + _F_FLAGS) & _RANDOM) != 0:
        parts = tl.arange(0, PARTS_PAD)
        w_max = tl.max(tl.load(stats_value_ptr + row * PARTS + parts, mask=parts < PARTS, other=float("-inf")),
                       axis=0)
        inv_t = tl.load(params + _F_INV_T).to(tl.float32, bitcast=True)
        log_min_p = tl.load(params + _F_LOG_MIN_P).to(tl.float32, bitcast=True)
        levels = tl.arange(0, LEVELS)
        edges = -_LEVEL_STEP * (levels + 1).to(tl.float32)
        total = tl.zeros([SCAN_BLOCK], dtype=tl.float32)         # accumulated across the part, summed once
        counts = tl.zeros([LEVELS, SCAN_BLOCK], dtype=tl.int32)
        masses = tl.zeros([LEVELS, SCAN_BLOCK], dtype=tl.float32)
        for t in range(CHUNK // SCAN_BLOCK):
            offs = part * CHUNK + t * SCAN_BLOCK + tl.arange(0, SCAN_BLOCK)
            w = tl.load(w_ptr + row.to(tl.int64) * stride_w + offs, mask=offs < V, other=float("-inf"))
            x = (w - w_max) * inv_t
            finite = w > float("-inf")
            mass = tl.where(finite & (x >= log_min_p), tl.exp(x), 0.0)
            total += mass
            above = finite[None, :] & (x[None, :] >= edges[:, None])
            counts += above.to(tl.int32)
            masses += tl.where(above, mass[None, :], 0.0)
        out = scan_ptr + (row * PARTS + part) * (1 + 2 * LEVELS)
        tl.store(out, tl.sum(total, axis=0))
        tl.store(out + 1 + levels, tl.sum(counts, axis=1).to(tl.float32))
        tl.store(out + 1 + LEVELS + levels, tl.sum(masses, axis=1))


@triton.jit
def _row_cuts(params):
    """A row's parameter record read for the candidate path: random (else greedy), top-k, top-p, log min-p."""
    is_random = (tl.load(params + _F_FLAGS) & _RANDOM) != 0
    top_k = tl.load(params + _F_TOP_K)
    top_p = tl.load(params + _F_TOP_P).to(tl.float32, bitcast=True)
    log_min_p = tl.load(params + _F_LOG_MIN_P).to(tl.float32, bitcast=True)
    return is_random, top_k, top_p, log_min_p


@triton.jit
def _choose_level(scan_ptr, row, has_k, has_p, top_k, top_p, log_min_p,
                  PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, LEVELS: tl.constexpr, CAPACITY: tl.constexpr):
    """The highest level whose tokens hold every token the row may keep, if at most CAPACITY: (level or
    -1, its token count, the row's min-p mass). Every kernel that calls it decides the same."""
    parts = tl.arange(0, PARTS_PAD)
    levels = tl.arange(0, LEVELS)
    stats = scan_ptr + (row * PARTS + parts[:, None]) * (1 + 2 * LEVELS) + 1 + levels[None, :]
    in_row = (parts < PARTS)[:, None]
    counts = tl.sum(tl.load(stats, mask=in_row, other=0.0), axis=0)
    masses = tl.sum(tl.load(stats + LEVELS, mask=in_row, other=0.0), axis=0)
    total = tl.sum(tl.load(scan_ptr + (row * PARTS + parts) * (1 + 2 * LEVELS), mask=parts < PARTS, other=0.0),
                   axis=0)
    edges = -_LEVEL_STEP * (levels + 1).to(tl.float32)
    holds = tl.where(has_k, counts >= top_k.to(tl.float32),
                     tl.where(has_p, masses >= top_p * total, edges <= log_min_p))
    fits = holds & (counts <= CAPACITY)
    level = tl.min(tl.where(fits, levels, LEVELS), axis=0)
    level = tl.where(level < LEVELS, level, -1)
    count = tl.sum(tl.where(levels == level, counts, 0.0), axis=0)
    return level, count.to(tl.int32), total


@triton.jit(do_not_specialize=["slots_ptr"])
def _compact_kernel(
    w_ptr, stride_w, slots_ptr, params_ptr, stats_value_ptr, tile_max_ptr, scan_ptr, cand_value_ptr,
    cand_index_ptr, V,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
    LEVELS: tl.constexpr, CAPACITY: tl.constexpr,
):
    """The tokens of the chosen level into the row's candidate list, in token order (parts in turn)."""
    TILES: tl.constexpr = CHUNK // BLOCK
    row = tl.program_id(0)
    part = tl.program_id(1)
    params = params_ptr + tl.load(slots_ptr + row) * _NUM_FIELDS
    is_random, top_k, top_p, log_min_p = _row_cuts(params)
    level, count, total = _choose_level(scan_ptr, row, is_random & (top_k > 0), is_random & (top_p < 1.0), top_k,
                                        top_p, log_min_p, PARTS, PARTS_PAD, LEVELS, CAPACITY)
    if is_random & (level >= 0):
        parts = tl.arange(0, PARTS_PAD)
        counts = tl.load(scan_ptr + (row * PARTS + parts) * (1 + 2 * LEVELS) + 1 + level, mask=parts < part,
                         other=0.0)
        filled = tl.sum(counts, axis=0).to(tl.int32)
        w_max = tl.max(tl.load(stats_value_ptr + row * PARTS + parts, mask=parts < PARTS, other=float("-inf")),
                       axis=0)
        inv_t = tl.load(params + _F_INV_T).to(tl.float32, bitcast=True)
        edge = -_LEVEL_STEP * (level + 1).to(tl.float32)
        for t in range(TILES):
            tile = part * TILES + t
            if (_tile_max_value(tile_max_ptr + row * (PARTS * TILES), tile) - w_max) * inv_t >= edge:
                offs = tile * BLOCK + tl.arange(0, BLOCK)
                w = tl.load(w_ptr + row.to(tl.int64) * stride_w + offs, mask=offs < V, other=float("-inf"))
                chosen = (w > float("-inf")) & ((w - w_max) * inv_t >= edge)
                at = filled + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
                chosen = chosen & (at < CAPACITY)           # always, as the scan counted the same tokens
                tl.store(cand_value_ptr + row * CAPACITY + at, w, mask=chosen)
                tl.store(cand_index_ptr + row * CAPACITY + at, offs, mask=chosen)
                filled += tl.sum(chosen.to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["slots_ptr", "positions_ptr"])
def _select_kernel(
    slots_ptr, positions_ptr, params_ptr, stats_value_ptr, scan_ptr, cand_value_ptr, cand_index_ptr,
    mode_ptr, drawn_ptr, V,
    PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, LEVELS: tl.constexpr, CAPACITY: tl.constexpr,
    PAIR: tl.constexpr,
):
    """One program per row: the row's mode, and for candidate rows top-k, top-p and the race over the
    candidates (top-k and top-p thresholds by counting and summing over all pairs, PAIR x PAIR at a time)."""
    row = tl.program_id(0)
    params = params_ptr + tl.load(slots_ptr + row) * _NUM_FIELDS
    is_random, top_k, top_p, log_min_p = _row_cuts(params)
    has_k = is_random & (top_k > 0)
    has_p = is_random & (top_p < 1.0)
    mode = tl.where(is_random, _MODE_RADIX, _MODE_GREEDY)
    if CAPACITY > 0:
        level, count, total = _choose_level(scan_ptr, row, has_k, has_p, top_k, top_p, log_min_p,
                                            PARTS, PARTS_PAD, LEVELS, CAPACITY)
        if is_random & (level >= 0):
            parts = tl.arange(0, PARTS_PAD)
            w_max = tl.max(tl.load(stats_value_ptr + row * PARTS + parts, mask=parts < PARTS,
                                   other=float("-inf")), axis=0)
            inv_t = tl.load(params + _F_INV_T).to(tl.float32, bitcast=True)
            values = cand_value_ptr + row * CAPACITY
            pair = tl.arange(0, PAIR)
            tau_k = tl.full([], float("-inf"), tl.float32)
            if has_k:                       # the largest value with at least k tokens at or above it
                for i in range(0, count, PAIR):
                    w_i = tl.load(values + i + pair, mask=i + pair < count, other=float("-inf"))
                    at_or_above = tl.zeros([PAIR], dtype=tl.float32)
                    for j in range(0, count, PAIR):
                        w_j = tl.load(values + j + pair, mask=j + pair < count, other=float("-inf"))
                        at_or_above += tl.sum(tl.where(w_j[None, :] >= w_i[:, None], 1.0, 0.0), axis=1)
                    reaching = (i + pair < count) & (at_or_above >= top_k.to(tl.float32))
                    tau_k = tl.maximum(tau_k, tl.max(tl.where(reaching, w_i, float("-inf")), axis=0))
            tau_p = tl.full([], float("-inf"), tl.float32)
            if has_p:                       # the largest kept value whose head holds top_p of the mass
                if has_k:
                    total = tl.full([], 0.0, tl.float32)
                    for j in range(0, count, PAIR):
                        w_j = tl.load(values + j + pair, mask=j + pair < count, other=float("-inf"))
                        x_j = (w_j - w_max) * inv_t
                        total += tl.sum(tl.where((w_j > float("-inf")) & (x_j >= log_min_p) & (w_j >= tau_k),
                                                 tl.exp(x_j), 0.0), axis=0)
                target = top_p * total
                reached = tl.full([], 0, tl.int32)
                for i in range(0, count, PAIR):
                    w_i = tl.load(values + i + pair, mask=i + pair < count, other=float("-inf"))
                    x_i = (w_i - w_max) * inv_t
                    head = tl.zeros([PAIR], dtype=tl.float32)
                    for j in range(0, count, PAIR):
                        w_j = tl.load(values + j + pair, mask=j + pair < count, other=float("-inf"))
                        x_j = (w_j - w_max) * inv_t
                        mass_j = tl.where((w_j > float("-inf")) & (x_j >= log_min_p) & (w_j >= tau_k),
                                          tl.exp(x_j), 0.0)
                        head += tl.sum(tl.where(w_j[None, :] >= w_i[:, None], mass_j[None, :], 0.0), axis=1)
                    reaching = ((w_i > float("-inf")) & (x_i >= log_min_p) & (w_i >= tau_k) & (head >= target))
                    tau_p = tl.maximum(tau_p, tl.max(tl.where(reaching, w_i, float("-inf")), axis=0))
                    reached += tl.sum(reaching.to(tl.int32), axis=0)
                if reached == 0:            # the level's mass and these sums disagree in the last bits
                    level = -1
            if level >= 0:
                position = tl.load(positions_ptr + row)
                seed_lo = tl.load(params + _F_SEED_LO)
                seed_hi = tl.load(params + _F_SEED_HI)
                best = tl.full([], float("-inf"), tl.float32)
                best_index = V
                for j in range(0, count, PAIR):
                    w_j = tl.load(values + j + pair, mask=j + pair < count, other=float("-inf"))
                    index = tl.load(cand_index_ptr + row * CAPACITY + j + pair, mask=j + pair < count, other=V)
                    x_j = (w_j - w_max) * inv_t
                    kept = (w_j > float("-inf")) & (x_j >= log_min_p) & (w_j >= tau_k) & (w_j >= tau_p)
                    exponential = -tl.log(counter_uniform(seed_lo, seed_hi, position, index, _PURPOSE_SAMPLE))
                    score = tl.where(kept, x_j + -tl.log(exponential.to(tl.float32)), float("-inf"))
                    block_best = tl.max(score, axis=0)
                    block_index = tl.min(tl.where(kept & (score == block_best), index, V), axis=0)
                    best_index = tl.where(block_best > best, block_index, best_index)
                    best = tl.maximum(best, block_best)
                tl.store(drawn_ptr + row, best_index)
                mode = _MODE_CANDIDATES
    tl.store(mode_ptr + row, mode)


# -- passes 1..16 -----------------------------------------------------------------------------------------

# The row count varies from step to step outside the decode graphs (steps carrying prompts sample any number
# of rows): neither specialized nor a block size of its own, so serving compiles no variant per row count.
# The rows' slot and position arrays are slices of a step's packed inputs, their alignment changing with the
# step's token count: no kernel here specializes on it (each reads one scalar per row from them), so a step
# never waits for a variant of another alignment (the H200 served its first requests seconds late for them).
@triton.jit(do_not_specialize=["pass_index", "rows", "slots_ptr", "positions_ptr"])
def _pass_kernel(
    w_ptr, stride_w, slots_ptr, positions_ptr, params_ptr, stats_value_ptr, tile_max_ptr, hist_ptr,
    state_ptr, race_value_ptr, race_index_ptr, mode_ptr,
    pass_index, V, max_rows, rows,
    DRAW: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
    ROWS_PAD: tl.constexpr,
):
    """A fixed grid walks the (row, part) items of the rows whose mode is radix; when no row is, each
    program reads the modes once and stops (the passes cost little for rows the candidate path took)."""
    all_rows = tl.arange(0, ROWS_PAD)
    modes = tl.load(mode_ptr + all_rows, mask=all_rows < rows, other=_MODE_GREEDY)
    if tl.max(tl.where(modes == _MODE_RADIX, 1, 0), axis=0) > 0:
        for item in range(tl.program_id(0), rows * PARTS, tl.num_programs(0)):
            row = item // PARTS
            if tl.load(mode_ptr + row) == _MODE_RADIX:
                _radix_pass(w_ptr, stride_w, slots_ptr, positions_ptr, params_ptr, stats_value_ptr, tile_max_ptr,
                            hist_ptr, state_ptr, race_value_ptr, race_index_ptr, pass_index, V, max_rows,
                            row, item % PARTS, DRAW, CHUNK, BLOCK, PARTS, PARTS_PAD)


@triton.jit
def _radix_pass(
    w_ptr, stride_w, slots_ptr, positions_ptr, params_ptr, stats_value_ptr, tile_max_ptr, hist_ptr,
    state_ptr, race_value_ptr, race_index_ptr, pass_index, V, max_rows, row, part,
    DRAW: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    """Pass `pass_index` of one row's radix select, for the tokens of one part of the row."""
    TILES: tl.constexpr = CHUNK // BLOCK
    params = params_ptr + tl.load(slots_ptr + row) * _NUM_FIELDS
    flags = tl.load(params + _F_FLAGS)
    is_random = (flags & _RANDOM) != 0
    has_k = is_random & (tl.load(params + _F_TOP_K) > 0)
    top_p = tl.load(params + _F_TOP_P).to(tl.float32, bitcast=True)
    has_p = is_random & (top_p < 1.0)
    first = tl.where(has_k, 0, 1)
    digits = tl.where(has_k, 8, 0) + tl.where(has_p, 8, 0)
    decide = (pass_index > first) & (pass_index <= first + digits)       # on the previous pass's digit
    histogram_now = (pass_index >= first) & (pass_index < first + digits)
    draw_now = is_random & (pass_index == first + digits) & DRAW
    if decide | histogram_now | draw_now:
        decided = tl.minimum(tl.maximum(pass_index - first, 0), digits)
        st = state_ptr + ((decided - decide.to(tl.int32)) * max_rows + row) * _STATE_FIELDS
        prefix = tl.load(st + _S_PREFIX).to(tl.uint32, bitcast=True)
        k_left = tl.load(st + _S_K_LEFT)
        tau_k = tl.load(st + _S_TAU_K).to(tl.uint32, bitcast=True)
        tau_p = tl.load(st + _S_TAU_P).to(tl.uint32, bitcast=True)
        mass_above = tl.load(st + _S_MASS_ABOVE).to(tl.float32, bitcast=True)
        target = tl.load(st + _S_TARGET).to(tl.float32, bitcast=True)
        if decide:
            previous = pass_index - 1 - first
            decided_digit = previous % 8
            parts = tl.arange(0, PARTS_PAD)
            partials = tl.load(hist_ptr + (((pass_index - 1) * max_rows + row) * PARTS + parts[:, None]) * 16
                               + tl.arange(0, 16)[None, :], mask=parts[:, None] < PARTS, other=0.0)
            totals = tl.sum(partials, axis=0)
            if has_k & (previous < 8):
                chosen, above = _choose_bin(totals, 0.0, k_left.to(tl.float32))
                k_left = k_left - above.to(tl.int32)
            else:
                if decided_digit == 0:
                    target = top_p * tl.sum(totals, axis=0)
                chosen, above = _choose_bin(totals, mass_above, target)
                mass_above = mass_above + above
            prefix = prefix | (chosen.to(tl.uint32) << (28 - 4 * decided_digit).to(tl.uint32))
            if decided_digit == 7:
                if has_k & (previous < 8):
                    tau_k = prefix
                else:
                    tau_p = prefix
                prefix = tl.full([], 0, tl.uint32)
            if part == 0:
                st = state_ptr + (decided * max_rows + row) * _STATE_FIELDS
                tl.store(st + _S_PREFIX, prefix.to(tl.int32, bitcast=True))
                tl.store(st + _S_K_LEFT, k_left)
                tl.store(st + _S_TAU_K, tau_k.to(tl.int32, bitcast=True))
                tl.store(st + _S_TAU_P, tau_p.to(tl.int32, bitcast=True))
                tl.store(st + _S_MASS_ABOVE, mass_above.to(tl.int32, bitcast=True))
                tl.store(st + _S_TARGET, target.to(tl.int32, bitcast=True))
        if histogram_now | draw_now:
            relative = pass_index - first
            counting = has_k & (relative < 8)                   # top-k counts; top-p sums masses
            digit = tl.where(draw_now, 0, relative % 8)
            shift = (28 - 4 * digit).to(tl.uint32)
            one = tl.full([], 1, tl.int64)
            high_mask = ((one << 32) - (one << (32 - 4 * digit).to(tl.int64))).to(tl.uint32)
            lower = tl.where(draw_now, tl.maximum(tau_k, tau_p), tl.where(counting, prefix, tl.maximum(tau_k, prefix)))
            parts = tl.arange(0, PARTS_PAD)
            w_max = tl.max(tl.load(stats_value_ptr + row * PARTS + parts, mask=parts < PARTS,
                                   other=float("-inf")), axis=0)
            inv_t = tl.load(params + _F_INV_T).to(tl.float32, bitcast=True)
            log_min_p = tl.load(params + _F_LOG_MIN_P).to(tl.float32, bitcast=True)
            position = tl.load(positions_ptr + row)
            seed_lo = tl.load(params + _F_SEED_LO)
            seed_hi = tl.load(params + _F_SEED_HI)
            bins = tl.arange(0, 16)
            hist = tl.zeros([16], dtype=tl.float32)
            best = tl.full([], float("-inf"), tl.float32)
            best_index = V
            for t in range(TILES):
                tile = part * TILES + t
                tile_max = tl.load(tile_max_ptr + row * (PARTS * TILES) + tile).to(tl.uint32, bitcast=True)
                if tile_max >= lower:                           # else no candidate here: skip the tile
                    offs = tile * BLOCK + tl.arange(0, BLOCK)
                    in_range = offs < V
                    w = tl.load(w_ptr + row.to(tl.int64) * stride_w + offs, mask=in_range, other=float("-inf"))
                    bits = w.to(tl.int32, bitcast=True)
                    key = (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)
                    x = (w - w_max) * inv_t
                    kept = in_range & (w > float("-inf")) & (x >= log_min_p) & (key >= lower)
                    if draw_now:
                        exponential = -tl.log(counter_uniform(seed_lo, seed_hi, position, offs, _PURPOSE_SAMPLE))
                        gumbel = -tl.log(exponential.to(tl.float32))       # as gumbel_noise in the reference
                        score = tl.where(kept, x + gumbel, float("-inf"))
                        tile_best = tl.max(score, axis=0)
                        best_index = tl.where(tile_best > best, tile * BLOCK + tl.argmax(score, axis=0), best_index)
                        best = tl.maximum(best, tile_best)
                    else:
                        valid = tl.where(counting, in_range, kept) & ((key & high_mask) == prefix)
                        weight = tl.where(counting, 1.0, tl.exp(x))
                        hit = valid[:, None] & (((key >> shift) & 15).to(tl.int32)[:, None] == bins[None, :])
                        hist += tl.sum(tl.where(hit, weight[:, None], 0.0), axis=0)
            if draw_now:
                tl.store(race_value_ptr + row * PARTS + part, best)
                tl.store(race_index_ptr + row * PARTS + part, tl.where(best > float("-inf"), best_index, V))
            else:
                tl.store(hist_ptr + ((pass_index * max_rows + row) * PARTS + part) * 16 + bins, hist)


# -- finish -----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["slots_ptr"])
def _finish_kernel(
    out_ptr, slots_ptr, params_ptr, counts_ptr, stride_counts, stats_value_ptr, stats_index_ptr,
    race_value_ptr, race_index_ptr, mode_ptr, drawn_ptr, V, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    flags = tl.load(params_ptr + slot * _NUM_FIELDS + _F_FLAGS)
    mode = tl.load(mode_ptr + row)
    parts = tl.arange(0, PARTS_PAD)
    values = tl.load(stats_value_ptr + row * PARTS + parts, mask=parts < PARTS, other=float("-inf"))
    indices = tl.load(stats_index_ptr + row * PARTS + parts, mask=parts < PARTS, other=V)
    token = tl.min(tl.where(values == tl.max(values, axis=0), indices, V), axis=0)     # first argmax
    if mode == _MODE_CANDIDATES:
        drawn = tl.load(drawn_ptr + row)
        token = tl.where(drawn < V, drawn, token)               # V: the row kept nothing
    if mode == _MODE_RADIX:
        values = tl.load(race_value_ptr + row * PARTS + parts, mask=parts < PARTS, other=float("-inf"))
        indices = tl.load(race_index_ptr + row * PARTS + parts, mask=parts < PARTS, other=V)
        drawn = tl.min(tl.where(values == tl.max(values, axis=0), indices, V), axis=0)
        token = tl.where(drawn < V, drawn, token)               # V: the row kept nothing
    tl.store(out_ptr + row, token.to(tl.int64))
    if (flags & _PENALTIES) != 0:
        tl.atomic_add(counts_ptr + slot * stride_counts + token, 1)


# -- the processed distribution (speculation) -------------------------------------------------------------

@triton.jit(do_not_specialize=["slots_ptr"])
def _probs_kernel(
    probs_ptr, stride_probs, w_ptr, stride_w, slots_ptr, params_ptr, stats_value_ptr, stats_index_ptr,
    state_ptr, kept_mass_ptr, V, max_rows,
    NORMALIZE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
):
    """NORMALIZE False: each part's kept mass; True: the probabilities (one-hot at the argmax when the row
    is greedy or keeps nothing)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    params = params_ptr + tl.load(slots_ptr + row) * _NUM_FIELDS
    flags = tl.load(params + _F_FLAGS)
    is_random = (flags & _RANDOM) != 0
    has_k = is_random & (tl.load(params + _F_TOP_K) > 0)
    has_p = is_random & (tl.load(params + _F_TOP_P).to(tl.float32, bitcast=True) < 1.0)
    st = state_ptr + ((tl.where(has_k, 8, 0) + tl.where(has_p, 8, 0)) * max_rows + row) * _STATE_FIELDS
    tau = tl.maximum(tl.load(st + _S_TAU_K).to(tl.uint32, bitcast=True),
                     tl.load(st + _S_TAU_P).to(tl.uint32, bitcast=True))
    inv_t = tl.load(params + _F_INV_T).to(tl.float32, bitcast=True)
    log_min_p = tl.load(params + _F_LOG_MIN_P).to(tl.float32, bitcast=True)
    parts = tl.arange(0, PARTS_PAD)
    values = tl.load(stats_value_ptr + row * PARTS + parts, mask=parts < PARTS, other=float("-inf"))
    indices = tl.load(stats_index_ptr + row * PARTS + parts, mask=parts < PARTS, other=V)
    w_max = tl.max(values, axis=0)
    argmax = tl.min(tl.where(values == w_max, indices, V), axis=0)
    total = tl.sum(tl.load(kept_mass_ptr + row * PARTS + parts, mask=parts < PARTS, other=0.0), axis=0)
    mass = tl.full([], 0.0, tl.float32)
    for t in range(CHUNK // BLOCK):
        offs = part * CHUNK + t * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < V
        w = tl.load(w_ptr + row.to(tl.int64) * stride_w + offs, mask=in_range, other=float("-inf"))
        bits = w.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)
        x = (w - w_max) * inv_t
        kept = is_random & in_range & (w > float("-inf")) & (x >= log_min_p) & (key >= tau)
        if NORMALIZE:
            probs = tl.where(kept, tl.exp(x) / tl.where(total > 0.0, total, 1.0), 0.0)
            probs = tl.where(is_random & (total > 0.0), probs, tl.where(offs == argmax, 1.0, 0.0))
            tl.store(probs_ptr + row.to(tl.int64) * stride_probs + offs, probs, mask=in_range)
        else:
            mass += tl.sum(tl.where(kept, tl.exp(x), 0.0), axis=0)
    if not NORMALIZE:
        tl.store(kept_mass_ptr + row * PARTS + part, mass)


# -- launchers --------------------------------------------------------------------------------------------

def sample(logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, tables: SamplingTables,
           workspace: SamplingWorkspace, allowed_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [N] int64; penalty slots' output counts go up by one. Capturable: no host sync."""
    rows = _check(logits, slots, positions, tables, workspace, allowed_bitmask)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    config = workspace.config
    meta = _run_passes(logits, slots, positions, tables, workspace, allowed_bitmask, draw=True,
                       candidates=config.candidates if rows >= config.candidate_min_rows else 0)
    _finish_kernel[(rows,)](
        out, slots, tables.params, tables.output_counts, tables.output_counts.stride(0),
        workspace.stats_value, workspace.stats_index, workspace.race_value, workspace.race_index,
        workspace.row_mode, workspace.drawn, logits.shape[1], PARTS=meta["PARTS"], PARTS_PAD=meta["PARTS_PAD"],
        num_warps=1)
    return out


def target_probs(logits: torch.Tensor, slots: torch.Tensor, tables: SamplingTables, workspace: SamplingWorkspace,
                 allowed_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] float32: the distribution each row draws from (one-hot at the argmax for greedy rows)."""
    positions = torch.zeros_like(slots)
    rows = _check(logits, slots, positions, tables, workspace, allowed_bitmask)
    vocab_size = logits.shape[1]
    probs = torch.empty(rows, vocab_size, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return probs
    meta = _run_passes(logits, slots, positions, tables, workspace, allowed_bitmask, draw=False, candidates=0)
    grid = (rows, meta["PARTS"])
    common = dict(CHUNK=meta["CHUNK"], BLOCK=meta["BLOCK"], PARTS=meta["PARTS"], PARTS_PAD=meta["PARTS_PAD"],
                  num_warps=workspace.config.num_warps)
    w = workspace.logits
    for normalize in (False, True):
        _probs_kernel[grid](probs, probs.stride(0), w, w.stride(0), slots, tables.params, workspace.stats_value,
                            workspace.stats_index, workspace.state, workspace.kept_mass, vocab_size,
                            workspace.max_rows, NORMALIZE=normalize, **common)
    return probs


@triton.jit
def _uniform_kernel(out_ptr, seed_lo_ptr, seed_hi_ptr, positions_ptr, indices, purpose, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    uniform = counter_uniform(tl.load(seed_lo_ptr + row), tl.load(seed_hi_ptr + row), tl.load(positions_ptr + row),
                              offs, purpose)
    tl.store(out_ptr + row * indices + offs, uniform, mask=offs < indices)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, num_indices: int,
             purpose: int) -> torch.Tensor:
    """[N, num_indices] float64: u(seed[i], positions[i], j, purpose) for j < num_indices, from the kernel."""
    rows = positions.shape[0]
    out = torch.empty(rows, num_indices, dtype=torch.float64, device=positions.device)
    block = min(1024, triton.next_power_of_2(max(num_indices, 1)))
    _uniform_kernel[(rows, triton.cdiv(num_indices, block))](
        out, seed_lo.to(torch.int32).contiguous(), seed_hi.to(torch.int32).contiguous(), positions.contiguous(),
        num_indices, purpose, BLOCK=block)
    return out


def _run_passes(logits, slots, positions, tables: SamplingTables, workspace: SamplingWorkspace,
                allowed_bitmask, draw: bool, candidates: int) -> dict:
    """prepare; with `candidates`, scan, compact and select (rows that fit their candidate list are then
    done); every row's mode; the radix passes for the rest. `candidates` 0: every random row is radix."""
    rows, vocab_size = logits.shape
    config = workspace.config
    parts = config.parts(vocab_size)
    meta = dict(CHUNK=config.chunk, BLOCK=config.block, PARTS=parts)
    grid = (rows, parts)
    w = workspace.logits
    mask = allowed_bitmask if allowed_bitmask is not None else tables.prompt_bits
    _prepare_kernel[grid](
        logits, logits.stride(0), w, w.stride(0), slots, tables.params,
        tables.prompt_bits, tables.prompt_bits.stride(0), tables.output_counts, tables.output_counts.stride(0),
        tables.bias_ids, tables.bias_values, mask, mask.stride(0),
        workspace.stats_value, workspace.stats_index, workspace.tile_max, workspace.hist, workspace.state,
        vocab_size, workspace.max_rows, HAS_MASK=allowed_bitmask is not None,
        BIAS_WIDTH=tables.bias_ids.shape[1], **meta, num_warps=config.num_warps,
        enable_fp_fusion=False)          # w must be the reference's bit for bit: no fused multiply-adds
    meta["PARTS_PAD"] = triton.next_power_of_2(parts)
    shape = dict(PARTS=parts, PARTS_PAD=meta["PARTS_PAD"], LEVELS=LEVELS)
    if candidates:
        _scan_kernel[grid](
            w, w.stride(0), slots, tables.params, workspace.stats_value, workspace.scan, vocab_size,
            CHUNK=config.chunk, SCAN_BLOCK=config.scan_block, **shape, num_warps=config.num_warps,
            enable_fp_fusion=False)
        _compact_kernel[grid](
            w, w.stride(0), slots, tables.params, workspace.stats_value, workspace.tile_max, workspace.scan,
            workspace.cand_value, workspace.cand_index, vocab_size, CHUNK=config.chunk, BLOCK=config.block,
            **shape, CAPACITY=candidates, num_warps=config.num_warps, enable_fp_fusion=False)
    _select_kernel[(rows,)](
        slots, positions, tables.params, workspace.stats_value, workspace.scan, workspace.cand_value,
        workspace.cand_index, workspace.row_mode, workspace.drawn, vocab_size, **shape, CAPACITY=candidates,
        PAIR=config.pair_block, num_warps=8, enable_fp_fusion=False)        # one program per row: more warps
    radix_grid = (min(rows * parts, config.radix_programs),)
    for pass_index in range(1, NUM_PASSES):
        _pass_kernel[radix_grid](
            w, w.stride(0), slots, positions, tables.params, workspace.stats_value, workspace.tile_max,
            workspace.hist, workspace.state, workspace.race_value, workspace.race_index, workspace.row_mode,
            pass_index, vocab_size, workspace.max_rows, rows, DRAW=draw, **meta,
            ROWS_PAD=triton.next_power_of_2(workspace.max_rows), num_warps=config.num_warps)
    return meta


def _check(logits, slots, positions, tables: SamplingTables, workspace: SamplingWorkspace, allowed_bitmask) -> int:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sampling: logits must be [N, V] with a contiguous last dimension, got {list(logits.shape)}")
    rows, vocab_size = logits.shape
    if vocab_size != tables.vocab_size or workspace.logits.shape[1] != vocab_size:
        raise ValueError(f"sampling: logits have {vocab_size} columns, the tables {tables.vocab_size} and the "
                         f"workspace {workspace.logits.shape[1]}")
    if rows > workspace.max_rows:
        raise ValueError(f"sampling: {rows} rows but the workspace holds {workspace.max_rows}")
    for name, tensor in (("slots", slots), ("positions", positions)):
        if tensor.shape != (rows,) or tensor.dtype != torch.int64 or tensor.device != logits.device:
            raise ValueError(f"sampling: {name} must be int64 [{rows}] on {logits.device}, got "
                             f"{tensor.dtype} {list(tensor.shape)} on {tensor.device}")
    if allowed_bitmask is not None:
        expected = (rows, bitmask_words(vocab_size))
        if (allowed_bitmask.shape != expected or allowed_bitmask.dtype != torch.int32
                or allowed_bitmask.stride(1) != 1):
            raise ValueError(f"sampling: allowed_bitmask must be int32 {list(expected)} with a contiguous last "
                             f"dimension, got {allowed_bitmask.dtype} {list(allowed_bitmask.shape)}")
    return rows
