"""The device sampler's tables, its counter-based random numbers, and its torch reference.

flare.kernels.sampling runs the same sampling in Triton kernels; this module is what they are checked
against and what a machine without CUDA runs. It imports no Triton (a CPU-only install has none).

Per row, in this order (engine/sampler.py states the same for users):
  w = logits (fp32), then
    repetition penalty on tokens seen in the prompt or the output: w / r where w > 0, w * r elsewhere;
    presence and frequency penalties on output counts c: w - (f * c + p * [c > 0]);
    logit bias, added; the allowed-token mask (-inf where its bit is clear); -0.0 becomes +0.0.
  Greedy rows: the first index of the largest w.
  Random rows, with x = (w - max w) * (1 / temperature):
    min-p keeps x >= log(min_p), i.e. p >= min_p * max p;
    top-k keeps w >= the k-th largest w;
    top-p keeps, of what min-p and top-k left (H), the tokens with w >= tau, tau the largest value
      whose head {w >= tau} holds at least top_p of H's probability mass: the smallest head whose mass
      reaches top_p of the distribution renormalised after top-k;
    then one token is drawn from what is kept: the first index of the largest x + g, with g a Gumbel
      variate made from the counter-based uniform u(seed, position, token, PURPOSE_SAMPLE) (the
      exponential race, an exact draw from the kept tokens' renormalised probabilities).
Ties at a threshold are all kept: top-k keeps every token equal to the k-th largest (as vLLM's torch
reference does), and top-p's head takes in the whole group of tokens equal to its last member. A row
that keeps no token (its mask allows none) gets the first index of the largest w.

Random numbers: Philox4x32-10 (Salmon et al., SC'11; Random123's known answers in the tests) keyed by
the request's 64-bit seed, counting (token index, position low, position high, purpose). 52 bits of
two output words give a uniform in (0, 1); the exponential variate -log(u) is taken in float64 so that
tokens far below the maximum keep their (tiny) chance. A request's draws depend only on its seed and
positions: batch-invariant, reproducible, and the same here and in the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


# -- the per-slot parameter table: one int32 row per slot, floats stored as their bits ----------------------
FIELD_FLAGS = 0
FIELD_TOP_K = 1                 # 0: no top-k
FIELD_TOP_P = 2                 # float; 1.0: no top-p
FIELD_INV_TEMPERATURE = 3       # float
FIELD_LOG_MIN_P = 4             # float; -inf: no min-p
FIELD_REPETITION = 5            # float
FIELD_PRESENCE = 6              # float
FIELD_FREQUENCY = 7             # float
FIELD_SEED_LO = 8
FIELD_SEED_HI = 9
FIELD_NUM_BIAS = 10
NUM_FIELDS = 16

FLAG_RANDOM = 1                 # not greedy
FLAG_PENALTIES = 2              # reads the prompt bits and output counts
FLAG_BIAS = 4                   # reads the bias entries

UNUSED_BIAS_ID = 2 ** 31 - 1     # above every tile, so a tile's entries are a run of the ascending ids
SAMPLING_EPS = 1e-5             # temperatures below it sample greedily (as vLLM's _SAMPLING_EPS)

PURPOSE_SAMPLE = 0              # the draw of a token
PURPOSE_ACCEPT = 1              # speculative decoding: the acceptance test of a draft token
PURPOSE_RESIDUAL = 2            # speculative decoding: the draw from the residual distribution

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SlotParams:
    """What the kernels read of one request, already in their units (see the module docstring)."""

    random: bool
    top_k: int = 0
    top_p: float = 1.0
    inv_temperature: float = 1.0
    log_min_p: float = -math.inf
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0                   # 64 bits
    num_bias: int = 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def encode(self) -> torch.Tensor:
        """The table row: int32 [NUM_FIELDS]."""
        floats = torch.tensor([self.top_p, self.inv_temperature, self.log_min_p, self.repetition_penalty,
                               self.presence_penalty, self.frequency_penalty], dtype=torch.float32)
        row = torch.zeros(NUM_FIELDS, dtype=torch.int32)
        row[FIELD_FLAGS] = ((FLAG_RANDOM if self.random else 0) | (FLAG_PENALTIES if self.uses_penalties else 0)
                            | (FLAG_BIAS if self.num_bias else 0))
        row[FIELD_TOP_K] = self.top_k
        row[[FIELD_TOP_P, FIELD_INV_TEMPERATURE, FIELD_LOG_MIN_P, FIELD_REPETITION, FIELD_PRESENCE,
             FIELD_FREQUENCY]] = floats.view(torch.int32)
        row[FIELD_SEED_LO] = _as_int32(self.seed & _MASK32)
        row[FIELD_SEED_HI] = _as_int32((self.seed >> 32) & _MASK32)
        row[FIELD_NUM_BIAS] = self.num_bias
        return row


def _as_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


@dataclass(frozen=True)
class SamplingTables:
    """Per-slot state on the device, written when a request takes a slot; the kernels read it by slot."""

    params: torch.Tensor            # [slots, NUM_FIELDS] int32
    prompt_bits: torch.Tensor       # [slots, ceil(V / 32)] int32: bit t % 32 of word t // 32 = t in the prompt
    output_counts: torch.Tensor     # [slots, V] int32: how often each token was sampled (penalty slots only)
    bias_ids: torch.Tensor          # [slots, bias width] int32, ascending, distinct; unused: UNUSED_BIAS_ID
    bias_values: torch.Tensor       # [slots, bias width] float32

    @staticmethod
    def allocate(num_slots: int, vocab_size: int, device: torch.device | str, bias_width: int) -> SamplingTables:
        """`bias_width`: the most logit-bias entries a slot holds (a power of two: the kernels load a row whole)."""
        if bias_width < 1 or bias_width & (bias_width - 1):
            raise ValueError(f"the bias width must be a power of two, not {bias_width}")
        return SamplingTables(
            params=torch.zeros(num_slots, NUM_FIELDS, dtype=torch.int32, device=device),
            prompt_bits=torch.zeros(num_slots, bitmask_words(vocab_size), dtype=torch.int32, device=device),
            output_counts=torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device),
            bias_ids=torch.full((num_slots, bias_width), UNUSED_BIAS_ID, dtype=torch.int32, device=device),
            bias_values=torch.zeros(num_slots, bias_width, dtype=torch.float32, device=device))

    @property
    def vocab_size(self) -> int:
        return self.output_counts.shape[1]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_bits(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """int32 [ceil(V / 32)] with bit t % 32 of word t // 32 set for each t in token_ids."""
    present = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.int64)
    if len(token_ids):
        present[torch.as_tensor(token_ids, dtype=torch.int64)] = 1
    words = (present.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., ceil(V / 32)] int32 -> [..., V] bool."""
    tokens = torch.arange(vocab_size, device=words.device)
    return ((words[..., tokens // 32] >> (tokens % 32)) & 1).bool()


# -- counter-based random numbers -------------------------------------------------------------------------

def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of multiplier * x for 32-bit values held in int64 (in 16-bit halves: no overflow)."""
    low_half = multiplier * (x & 0xFFFF)                  # < 2**48
    high_half = multiplier * (x >> 16)                    # < 2**48
    middle = high_half + (low_half >> 16)
    return middle >> 16, ((middle & 0xFFFF) << 16) | (low_half & 0xFFFF)


def philox4x32(counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor],
               rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 on 32-bit words held in int64 tensors (broadcast together); returns the 4 output words."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & _MASK32 for k in key)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & _MASK32, (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def counter_uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
                    indices: torch.Tensor, purpose: int) -> torch.Tensor:
    """float64 uniforms in (0, 1), broadcast over the inputs: u(seed, position, index, purpose).

    Seeds are the two 32-bit words (any int dtype; negative int32 values are their bit patterns)."""
    positions = positions.to(torch.int64)
    w0, w1, _, _ = philox4x32((indices, positions & _MASK32, positions >> 32, torch.tensor(purpose)),
                              (seed_lo, seed_hi))
    bits52 = (w0 << 20) | (w1 >> 12)
    return (bits52.double() + 0.5) * 2.0 ** -52


def gumbel_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
                 indices: torch.Tensor, purpose: int = PURPOSE_SAMPLE) -> torch.Tensor:
    """float32 Gumbel variates -log(-log u): the exponential -log u in float64, its log in float32."""
    exponential = -torch.log(counter_uniform(seed_lo, seed_hi, positions, indices, purpose))
    return -torch.log(exponential.float())


# -- the reference sampler --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowParams:
    """The table fields of a batch's rows, gathered by slot and decoded (tensors of shape [N] or [N, 1])."""

    flags: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    inv_temperature: torch.Tensor
    log_min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor

    @staticmethod
    def gather(tables: SamplingTables, slots: torch.Tensor) -> RowParams:
        ints = tables.params[slots.long()]
        floats = ints.view(torch.float32)
        return RowParams(
            flags=ints[:, FIELD_FLAGS, None], top_k=ints[:, FIELD_TOP_K, None], top_p=floats[:, FIELD_TOP_P, None],
            inv_temperature=floats[:, FIELD_INV_TEMPERATURE, None], log_min_p=floats[:, FIELD_LOG_MIN_P, None],
            repetition=floats[:, FIELD_REPETITION, None], presence=floats[:, FIELD_PRESENCE, None],
            frequency=floats[:, FIELD_FREQUENCY, None], seed_lo=ints[:, FIELD_SEED_LO, None],
            seed_hi=ints[:, FIELD_SEED_HI, None])

    def has(self, flag: int) -> torch.Tensor:
        return (self.flags & flag) != 0


def processed_logits(logits: torch.Tensor, slots: torch.Tensor, tables: SamplingTables,
                     allowed_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """w: penalties, logit bias and the mask applied to fp32 logits [N, V]."""
    row = RowParams.gather(tables, slots)
    w = logits.float()
    vocab_size = w.shape[1]
    counts = tables.output_counts[slots].float()
    seen = unpack_bits(tables.prompt_bits[slots], vocab_size) | (counts > 0)
    penalized = torch.where(seen, torch.where(w > 0, w / row.repetition, w * row.repetition), w)
    penalized = penalized - (row.frequency * counts + row.presence * (counts > 0).float())
    w = torch.where(row.has(FLAG_PENALTIES), penalized, w)
    bias = torch.zeros_like(w)
    ids = tables.bias_ids[slots].long()
    used = (ids < vocab_size) & row.has(FLAG_BIAS)
    bias.scatter_add_(1, torch.where(used, ids, 0), torch.where(used, tables.bias_values[slots], 0.0))
    w = w + bias
    if allowed_bitmask is not None:
        w = torch.where(unpack_bits(allowed_bitmask, vocab_size), w, -math.inf)
    return torch.where(w == 0, 0.0, w)                       # -0.0 -> +0.0


def kept_tokens(w: torch.Tensor, slots: torch.Tensor, tables: SamplingTables) -> torch.Tensor:
    """[N, V] bool: the tokens a random row may draw after min-p, top-k and top-p (all False for greedy rows)."""
    row = RowParams.gather(tables, slots)
    vocab_size = w.shape[1]
    w_max = w.max(dim=1, keepdim=True).values
    x = (w - w_max) * row.inv_temperature
    kept = (w > -math.inf) & (x >= row.log_min_p) & row.has(FLAG_RANDOM)
    descending = w.sort(dim=1, descending=True).values
    k = row.top_k.long().clamp(1, vocab_size)
    kth_largest = descending.gather(1, k - 1)
    kept &= (row.top_k <= 0) | (w >= kth_largest)
    mass = torch.where(kept, torch.exp(x.double()), 0.0)
    head_values = torch.where(kept, w, -math.inf).sort(dim=1, descending=True)
    head_mass = mass.gather(1, head_values.indices).cumsum(dim=1)
    target = row.top_p.double() * head_mass[:, -1:]
    first_reaching = (head_mass < target).sum(dim=1, keepdim=True).clamp(max=vocab_size - 1)
    tau = head_values.values.gather(1, first_reaching)
    kept &= (row.top_p >= 1.0) | (w >= tau)
    return kept


def sample_reference(logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, tables: SamplingTables,
                     allowed_bitmask: torch.Tensor | None = None, update_counts: bool = True) -> torch.Tensor:
    """Token ids [N] int64 for fp32 logits [N, V], row i sampled for slots[i] at positions[i].

    With update_counts, each penalty slot's output count of its sampled token goes up by one."""
    w = processed_logits(logits, slots, tables, allowed_bitmask)
    kept = kept_tokens(w, slots, tables)
    row = RowParams.gather(tables, slots)
    tokens = torch.arange(w.shape[1], device=w.device)
    x = (w - w.max(dim=1, keepdim=True).values) * row.inv_temperature
    noise = gumbel_noise(row.seed_lo, row.seed_hi, positions[:, None], tokens[None, :], PURPOSE_SAMPLE)
    drawn = torch.where(kept, x + noise, -math.inf).argmax(dim=1)
    chosen = torch.where(kept.any(dim=1), drawn, w.argmax(dim=1))
    if update_counts:
        count_samples(tables, slots, chosen)
    return chosen


def count_samples(tables: SamplingTables, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Add one to each penalty slot's output count of its sampled token (rows may share a slot)."""
    uses = RowParams.gather(tables, slots).has(FLAG_PENALTIES)[:, 0]
    flat = slots.long() * tables.vocab_size + token_ids.long()
    tables.output_counts.view(-1).index_add_(0, flat, uses.to(torch.int32))


def target_probs_reference(logits: torch.Tensor, slots: torch.Tensor, tables: SamplingTables,
                           allowed_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] float32: the distribution each row draws from (a one-hot at the argmax for greedy rows)."""
    w = processed_logits(logits, slots, tables, allowed_bitmask)
    kept = kept_tokens(w, slots, tables)
    row = RowParams.gather(tables, slots)
    x = (w - w.max(dim=1, keepdim=True).values) * row.inv_temperature
    mass = torch.where(kept, torch.exp(x), 0.0)
    probs = mass / mass.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    one_hot = torch.nn.functional.one_hot(w.argmax(dim=1), w.shape[1]).float()
    return torch.where(kept.any(dim=1, keepdim=True), probs, one_hot)
