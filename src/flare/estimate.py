"""The capacity estimate made before weights load, the KV pool sized at startup, and the section-6
capacity error either raises.

Spec §1 "Estimate roughly, allocate from the device" and §6. From declared sizes (weights, graphs,
live state, the prefix cache at its floor, and the smallest KV pool memory mode accepts: 8,192 tokens per
active request, or 1,024 per request and one whole context where that is less, see
`flare.memory.pool_minimum`) the estimate decides whether a model fits the selected GPUs and which GPUs to take. When it does not fit, the error
gives the requirement, the supply, and options that each make it fit on their own:

    error: needs 68.3 GiB weights + 7.0 GiB graphs + 5.2 GiB live state + 0.9 GiB prefix cache
           + 0.8 GiB minimum pages (4 × 8,192 tokens) = 82.2 GiB;
           has 95.6 GiB free − 1.0 GiB headroom − 21.0 GiB reserve = 73.6 GiB.
           Options: [memory] reserve = "12G".

All sizes are plain numbers (bytes), so this module knows nothing of recipes or torch.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from flare.errors import CapacityError
from flare.memory import (GiB, MiB, Budget, FixedCosts, KVCacheLimit, KVGeometry, KVPool, WindowPool, format_gpus,
                          minimum_pages, pool_minimum, request_floor)

INDENT = " " * len("error: ")       # continuation lines line up under the first line's text


@dataclass(frozen=True)
class MemoryEstimate:
    """Declared sizes of the whole model (all tensor-parallel ranks together), in bytes."""

    weights_bytes: int                      # as loaded on the GPU
    graphs_bytes: int                       # graphs and scratch, on each GPU
    live_state_bytes_per_request: int       # execution rows of one active request, on each GPU
    prefix_cache_bytes_per_request: int     # the prefix cache at its floor, per active request
    kv_bytes_per_token: int                 # K and V of every layer, one token
    max_concurrency: int
    max_context: int                        # the prepared context (prompt + generated tokens)
    page_size: int                          # tokens per KV page
    tensor_parallel: int = 1
    window: WindowPool = WindowPool()       # window pages on each GPU (a cache with a window kind)
    kv_replicated: bool = False             # every rank holds the whole cache (one KV head read by all)

    def requirement(self) -> "Requirement":
        """The smallest per-GPU footprint the engine accepts at this concurrency and TP size.
        Weights and KV split across ranks; graphs and live state are counted on every rank."""
        tp = self.tensor_parallel
        minimum = pool_minimum(KVGeometry(self.page_size, self.kv_bytes_per_token, self.max_context,
                                          self.max_concurrency), "memory")
        return Requirement(
            weights=-(-self.weights_bytes // tp),
            graphs=self.graphs_bytes,
            live_state=self.live_state_bytes_per_request * self.max_concurrency,
            prefix_cache=-(-self.prefix_cache_bytes_per_request * self.max_concurrency // tp),
            minimum_pages=-(-self.kv_bytes_per_token * minimum.pages * self.page_size
                            // (1 if self.kv_replicated else tp)),
            minimum_text=minimum.text,
            window_pages=self.window.bytes(self.max_concurrency),
        )


@dataclass(frozen=True)
class Requirement:
    """Per-GPU bytes, as listed in the message."""

    weights: int
    graphs: int
    live_state: int
    prefix_cache: int
    minimum_pages: int
    minimum_text: str                       # what the minimum pages hold: "4 × 8,192 tokens"
    window_pages: int = 0                   # window pages (a cache with a window kind), shown when there are some

    @property
    def total(self) -> int:
        return self.weights + self.graphs + self.live_state + self.prefix_cache + self.minimum_pages + self.window_pages

    def text(self) -> str:
        pages = f"{_gib(self.minimum_pages)} minimum pages ({self.minimum_text})"
        window = f" + {_gib(self.window_pages)} window pages" if self.window_pages else ""
        return (f"needs {_gib(self.weights)} weights + {_gib(self.graphs)} graphs + "
                f"{_gib(self.live_state)} live state + {_gib(self.prefix_cache)} prefix cache\n"
                f"{INDENT}+ {pages}{window} = {_gib(self.total)};")


def _gib(size: int) -> str:
    return f"{size / GiB:.1f} GiB"


def supply_text(budget: Budget) -> str:
    if budget.limited_by_cap:
        first = f"{_gib(budget.occupied_cap)} memory limit"
    else:
        first = f"{_gib(budget.free)} {'free host memory' if budget.host else 'free'}"
    terms = [first, f"{_gib(budget.headroom)} headroom"]
    if budget.reserve:
        terms.append(f"{_gib(budget.reserve)} reserve")
    return f"has {' − '.join(terms)} = {_gib(budget.available)}."


def _error(requirement_text: str, budget: Budget, options: Sequence[str]) -> CapacityError:
    listed = "; ".join(options) if options else "none on these GPUs; the model needs a larger GPU"
    return CapacityError(f"{requirement_text}\n{INDENT}{supply_text(budget)}\n{INDENT}Options: {listed}.")


# ----------------------------------------------------------------------------------------------------
# Options, each computed so that applying it alone makes the requirement fit
# ----------------------------------------------------------------------------------------------------

def reserve_option(budget: Budget, needed: int) -> tuple[str, Budget] | None:
    """A smaller reserve (or a larger --memory-limit cap) that fits `needed` bytes, if one exists, with
    the budget it gives."""
    if budget.occupied_cap is not None:
        if not budget.limited_by_cap or budget.free - budget.headroom < needed:
            return None
        cap = -(-(needed + budget.headroom) // GiB)               # whole GiB, rounded up
        return f"--memory-limit {cap}G", replace(budget, occupied_cap=cap * GiB)
    if budget.reserve == 0:
        return None
    largest = budget.free - budget.headroom - needed
    if not 0 <= largest < budget.reserve:
        return None
    unit = GiB if largest >= GiB else MiB
    reserve = largest // unit * unit
    if budget.reserve_setting == "--memory-limit":
        return f"--memory-limit -{reserve // unit}{'G' if unit == GiB else 'M'}", replace(budget, reserve=reserve)
    size = "0" if reserve == 0 else f"{reserve // unit}{'G' if unit == GiB else 'M'}"
    return f'[memory] reserve = "{size}"', replace(budget, reserve=reserve)


def concurrency_option(estimate: MemoryEstimate, budgets: Sequence[Budget], margin: int = 0) -> str | None:
    """The largest lower --max-concurrency that fits every selected GPU."""
    for concurrency in range(estimate.max_concurrency - 1, 0, -1):
        needed = replace(estimate, max_concurrency=concurrency).requirement().total + margin
        if all(budget.available >= needed for budget in budgets):
            return f"--max-concurrency {concurrency}"
    return None


def gpus_option(estimate: MemoryEstimate, all_budgets: Sequence[Budget],
                tensor_parallel_sizes: Sequence[int], margin: int = 0) -> str | None:
    chosen = fitting_gpus(estimate, all_budgets, tensor_parallel_sizes, margin,
                          larger_than=estimate.tensor_parallel)
    return f"--gpus {format_gpus(chosen)}" if chosen else None


def fitting_gpus(estimate: MemoryEstimate, all_budgets: Sequence[Budget],
                 tensor_parallel_sizes: Sequence[int], margin: int = 0,
                 larger_than: int = 0) -> tuple[int, ...] | None:
    """The first GPUs (by index) at the smallest supported TP size whose estimate fits each of them."""
    for tp in sorted(size for size in tensor_parallel_sizes if size > larger_than):
        needed = replace(estimate, tensor_parallel=tp).requirement().total + margin
        roomy = [index for index, budget in enumerate(all_budgets) if budget.available >= needed]
        if len(roomy) >= tp:
            return tuple(roomy[:tp])
    return None


def _options(estimate: MemoryEstimate, budgets: Sequence[Budget], all_budgets: Sequence[Budget] | None,
             tensor_parallel_sizes: Sequence[int], margin: int = 0) -> list[str]:
    needed = estimate.requirement().total + margin
    tightest = min(budgets, key=lambda budget: budget.available)
    options = []
    reserve = reserve_option(tightest, needed)
    if reserve:                                    # the same setting applies to every selected GPU
        text, applied = reserve
        if all(replace(budget, reserve=applied.reserve, occupied_cap=applied.occupied_cap).available >= needed
               for budget in budgets):
            options.append(text)
    for option in (concurrency_option(estimate, budgets, margin),
                   gpus_option(estimate, all_budgets or (), tensor_parallel_sizes, margin)):
        if option:
            options.append(option)
    return options


# ----------------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------------

def check_estimate(estimate: MemoryEstimate, budgets: Sequence[Budget], *,
                   all_budgets: Sequence[Budget] | None = None,
                   tensor_parallel_sizes: Sequence[int] = (1,)) -> Requirement:
    """Refuse, before weights load, a model whose estimate does not fit the selected GPUs.

    budgets: one per selected GPU (memory.memory_budget). all_budgets: every visible GPU, indexed as
    --gpus counts them, so the error can offer more GPUs. Returns the per-GPU requirement when it fits.
    """
    requirement = estimate.requirement()
    if all(budget.available >= requirement.total for budget in budgets):
        return requirement
    tightest = min(budgets, key=lambda budget: budget.available)
    raise _error(requirement.text(), tightest,
                 _options(estimate, budgets, all_budgets, tensor_parallel_sizes))


def choose_gpus(estimate: MemoryEstimate, all_budgets: Sequence[Budget],
                tensor_parallel_sizes: Sequence[int]) -> tuple[int, ...]:
    """Without --gpus: the smallest supported TP size whose estimate fits the first roomy GPUs."""
    chosen = fitting_gpus(estimate, all_budgets, tensor_parallel_sizes)
    if chosen is not None:
        return chosen
    smallest = replace(estimate, tensor_parallel=min(tensor_parallel_sizes))
    first = list(all_budgets[:smallest.tensor_parallel])
    raise _error(smallest.requirement().text(), min(first, key=lambda budget: budget.available),
                 _options(smallest, first, all_budgets, tensor_parallel_sizes))


def pool_capacity_error(budget: Budget, fixed: FixedCosts, geometry: KVGeometry,
                        kv_cache_limit: KVCacheLimit) -> CapacityError:
    """Startup found too little memory for the KV pool's minimum (raised by size_kv_pool)."""
    minimum = pool_minimum(geometry, kv_cache_limit)
    requirement = Requirement(weights=fixed.weights, graphs=fixed.graphs, live_state=fixed.live_state,
                              prefix_cache=fixed.prefix_cache_floor,
                              minimum_pages=minimum.pages * geometry.bytes_per_page, minimum_text=minimum.text,
                              window_pages=fixed.window_pages)
    options = []
    reserve = reserve_option(budget, requirement.total)
    if reserve:
        options.append(reserve[0])
    room = budget.available - fixed.total
    fitting = [concurrency for concurrency in range(geometry.max_concurrency - 1, 0, -1)
               if pool_minimum(replace(geometry, max_concurrency=concurrency), kv_cache_limit).pages
               * geometry.bytes_per_page <= room]
    if fitting:
        options.append(f"--max-concurrency {fitting[0]}")
    if kv_cache_limit == "memory" and room >= geometry.max_concurrency * geometry.bytes_per_page:
        options.append("--kv-cache-limit concurrency")
    return _error(requirement.text(), budget, options)


# ----------------------------------------------------------------------------------------------------
# Allocation failures during preparation
# ----------------------------------------------------------------------------------------------------

def is_out_of_memory(error: BaseException) -> bool:
    """A device ran out of memory: torch's OutOfMemoryError, or a CUDA allocation failing outside the
    caching allocator (in a library, or a graph capture), which arrives as a RuntimeError saying so."""
    import sys

    torch = sys.modules.get("torch")              # no torch loaded: nothing on a device ran out of memory
    if torch is None:
        return False
    out_of_memory = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(error, out_of_memory) or (isinstance(error, RuntimeError)
                                                and "out of memory" in str(error).lower())


def failed_allocation(message: str) -> str:
    """The sentence of an out-of-memory message that says what failed ("Tried to allocate … is free."),
    on one line; the message's first line when it has none."""
    message = message.strip()
    quoted = re.search(r"Tried to allocate .*?(?:is free\.|$)", message, re.DOTALL)
    return " ".join((quoted[0] if quoted else message.splitlines()[0] if message else "").split())


def capacity_error_from_oom(error: BaseException, estimate: MemoryEstimate, budgets: Sequence[Budget], *,
                            all_budgets: Sequence[Budget] | None = None,
                            tensor_parallel_sizes: Sequence[int] = (1,)) -> CapacityError:
    """An allocation that failed although the estimate fit, reported in the §6 form, quoting the failed
    allocation; each option gives at least that allocation more room than the failed run had."""
    message = str(error).strip()
    quote = failed_allocation(message)
    size = re.search(r"Tried to allocate ([\d.]+) ([KMGT]i?B)", message)
    failed = int(float(size[1]) * {"K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}[size[2][0]]) if size else 0
    requirement = estimate.requirement()
    tightest = min(budgets, key=lambda budget: budget.available)
    # The estimate was low by an unknown amount: each option must give more room than this run had,
    # by at least the allocation that failed.
    margin = max(requirement.total, tightest.available) + failed - requirement.total
    text = (f"ran out of GPU memory during preparation: {quote}\n"
            f"{INDENT}The estimate fit, but this model is close to the limit: it {requirement.text()}")
    return _error(text, tightest, _options(estimate, budgets, all_budgets, tensor_parallel_sizes,
                                           margin=margin))


@contextmanager
def oom_as_capacity_error(estimate: MemoryEstimate, budgets: Sequence[Budget], *,
                          all_budgets: Sequence[Budget] | None = None,
                          tensor_parallel_sizes: Sequence[int] = (1,)) -> Iterator[None]:
    """Wrap a preparation phase: a GPU out-of-memory error inside becomes a CapacityError (exit 4)."""
    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        raise capacity_error_from_oom(error, estimate, budgets, all_budgets=all_budgets,
                                      tensor_parallel_sizes=tensor_parallel_sizes) from error


def size_kv_pool(budget: Budget, fixed: FixedCosts, geometry: KVGeometry,
                 kv_cache_limit: KVCacheLimit = "memory") -> KVPool:
    """Pages for the shared KV pool on one device; raises CapacityError (§6 form) below the minimum."""
    by_memory = max(0, budget.available - fixed.total) // geometry.bytes_per_page
    context_pages = geometry.pages_for(geometry.max_context)
    ceilings = {"memory": None, "context": context_pages,
                "concurrency": context_pages * geometry.max_concurrency}
    ceiling = ceilings[kv_cache_limit]
    if ceiling is not None and ceiling <= by_memory:
        pages, limited_by = ceiling, f"{kv_cache_limit} ceiling"
    else:
        pages, limited_by = by_memory, "memory"
    if pages < minimum_pages(geometry, kv_cache_limit):
        raise pool_capacity_error(budget, fixed, geometry, kv_cache_limit)
    floor = request_floor(pages, geometry) if kv_cache_limit == "memory" else None
    return KVPool(pages=pages, page_size=geometry.page_size, bytes=pages * geometry.bytes_per_page,
                  limited_by=limited_by, floor=floor)  # type: ignore[arg-type]
