"""Memory sizing: what each GPU has, what Flare may use of it, and how many KV pages that buys.

Spec §1 "Memory follows the model and the host", §4 "KV pages" and "Runtime memory limits". Weights,
graphs and scratch, live state and the prefix-cache floor come first; KV pages take the rest of the
device's free memory at startup, less engine headroom and the reserve (or within `--memory-limit`), and
are bounded by `--kv-cache-limit`. Free memory is read through NVML before CUDA starts; on a machine
without CUDA the same logic sizes against host memory, so it is tested on the CPU.

Importing this module imports neither torch nor NVML.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from flare.errors import CapacityError, UsageError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

PREPARATION_HEADROOM = 1 * GiB            # compiled warm-up and graph capture
HEADROOM_PER_PREFILL_TOKEN = 128 * KiB    # activations of each prefill token beyond the first 4,096
HEADROOM_FREE_PREFILL_TOKENS = 4096
# Serving: the CUDA context (0.74 GiB measured on an H200 with CUDA 13), allocator fragmentation and
# workspaces, beyond the graphs-and-scratch estimate; with 1.1 GiB less, prefill ran an H200 out of memory.
# The specification's serving margin is 64 MiB "after graph upload": its runtime maps KV pages into
# reserved address ranges once graphs are uploaded and measures what is left. Flare sizes the pool from
# NVML before the engine process starts and allocates it before capturing graphs (they hold its
# addresses), so this margin stands in for what that measurement would see. Export counts it too
# (prepare._fit_memory), so a package that prepares on a GPU also starts there.
SERVING_HEADROOM = 2 * GiB
# Memory mode's startup floor of KV tokens per active request: the specification's 8,192 while the pool
# can back it; at a concurrency where it cannot, the floor narrows so that concurrency × floor fits the
# pool, down to NARROWEST_TOKENS_PER_REQUEST, as long as the pool still holds one whole prepared context
# (issue 14's width rule, a stated divergence from the spec's fixed floor: 256 users of an 8B model on
# one H200). A full pool then makes admission wait and preempts by recomputation.
MEMORY_MODE_MIN_TOKENS_PER_REQUEST = 8192
NARROWEST_TOKENS_PER_REQUEST = 1024

KV_CACHE_LIMITS = ("memory", "context", "concurrency")
KVCacheLimit = Literal["memory", "context", "concurrency"]

_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB, "p": 1 << 50}
_SIZE = re.compile(r"^(?P<number>[0-9]*\.?[0-9]+)(?P<exponent>e[+-]?[0-9]+)?\s*(?P<unit>[kmgtp]?)(?:i?b)?$",
                   re.IGNORECASE)
_LARGEST_SIZE = (1 << 63) - 1


# ----------------------------------------------------------------------------------------------------
# Parsing the user's limits
# ----------------------------------------------------------------------------------------------------

def parse_size(text: str | int, what: str) -> int:
    """A byte count written with a binary suffix: 512M, 30G, 30GB, 30GiB, 1.5t (any case), or "0".

    The one size parser of flags and configuration (`flare.config` uses it too). `what` names the setting
    in the error. Every size but zero needs its unit; a whole number of bytes may be given as a TOML
    integer. Exponents are refused (write the digits), after a size too large to hold is reported as such.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise UsageError(f"{what} {text!r} is not a size: write a number with a binary unit, e.g. \"30G\"")
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"{what} must not be negative, not {text}")
        return text
    stripped = text.strip()
    if stripped == "0":
        return 0
    match = _SIZE.match(stripped)
    if not match or not match["unit"]:
        raise UsageError(f'{what} "{text}" is not a size: write a number with a binary unit, '
                         f'e.g. "512M", "30G" or "30GiB"')
    size = float(match["number"] + (match["exponent"] or "")) * _UNITS[match["unit"].lower()]
    if not math.isfinite(size) or size > _LARGEST_SIZE:
        raise UsageError(f'{what} "{text}" is too large')
    if match["exponent"]:
        raise UsageError(f'{what} "{text}": write the number in digits, e.g. "1000G", without an exponent')
    return int(size)


@dataclass(frozen=True)
class MemoryLimit:
    """`--memory-limit`: an occupied cap ("30G"), a free-memory reserve ("-30G", "-0G"), or a fraction
    of total memory used as the occupied cap ("0.8")."""

    kind: Literal["occupied", "reserve", "fraction"]
    size: int = 0                 # bytes, for occupied and reserve
    fraction: float = 0.0         # for fraction
    text: str = ""

    def occupied_cap(self, total: int) -> int | None:
        if self.kind == "occupied":
            return self.size
        if self.kind == "fraction":
            return int(self.fraction * total)
        return None


def parse_memory_limit(text: str) -> MemoryLimit:
    flag = "--memory-limit"
    stripped = text.strip()
    if stripped.startswith("-"):
        body = stripped[1:]
        if _is_bare_number(body):
            raise UsageError(f"{flag} {text}: a negative value must be a size such as -30G (memory to "
                             f"leave free); fractions are between 0 and 1")
        return MemoryLimit("reserve", size=parse_size(body, f"{flag} {text}:"), text=stripped)
    if _is_bare_number(stripped):
        fraction = float(stripped)
        if not math.isfinite(fraction) or not 0 < fraction <= 1:
            raise UsageError(f"{flag} {text}: a bare number is a fraction of total memory and must be "
                             f"greater than 0 and at most 1; sizes need a unit, e.g. 30G")
        return MemoryLimit("fraction", fraction=fraction, text=stripped)
    size = parse_size(stripped, f"{flag} {text}:")
    if size == 0:
        raise UsageError(f"{flag} {text}: an occupied limit of zero leaves nothing to serve with; "
                         f"use -0G to reserve nothing")
    return MemoryLimit("occupied", size=size, text=stripped)


def _is_bare_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_kv_cache_limit(text: str) -> KVCacheLimit:
    if text not in KV_CACHE_LIMITS:
        raise UsageError(f"--kv-cache-limit {text}: choose one of {', '.join(KV_CACHE_LIMITS)}")
    return text  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------------
# GPU selection
# ----------------------------------------------------------------------------------------------------

def parse_gpus(text: str) -> tuple[int, ...]:
    """`--gpus`: "0", "0,1", "0-3" or a mix ("0,2-3"); indices relative to CUDA_VISIBLE_DEVICES."""
    indices: list[int] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise UsageError(f"--gpus {text}: write GPU indices as 0, 0,1 or 0-3")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if last < first:
            raise UsageError(f"--gpus {text}: the range {part} runs backwards")
        indices.extend(range(first, last + 1))
    if len(set(indices)) != len(indices):
        raise UsageError(f"--gpus {text}: a GPU is named twice")
    return tuple(indices)


def format_gpus(indices: Sequence[int]) -> str:
    """The shortest `--gpus` spelling: 0-3 for a run, 0,2 otherwise."""
    ordered = list(indices)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    if len(ordered) == 2 and ordered[1] == ordered[0] + 1:
        return f"{ordered[0]}-{ordered[1]}"
    return ",".join(str(index) for index in ordered)


def visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries (indices or UUIDs), or None when unset.

    The one environment variable Flare reads: it changes which GPU each --gpus index names."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def check_gpu_selection(selection: Sequence[int], visible_count: int) -> None:
    visible = visible_devices()
    for index in selection:
        if index >= visible_count:
            where = f" of CUDA_VISIBLE_DEVICES={','.join(visible)}" if visible is not None else ""
            raise UsageError(f"--gpus {format_gpus(selection)}: GPU {index} does not exist; "
                             f"{visible_count} GPU{'s' if visible_count != 1 else ''}{where} visible")


def narrow_visible_devices(selection: Sequence[int]) -> str:
    """Set CUDA_VISIBLE_DEVICES to the selected GPUs in rank order, so that CUDA, started after this,
    numbers them 0, 1, ...; indices are relative to the caller's own CUDA_VISIBLE_DEVICES when set (spec
    §1: Flare sets the variables libraries read from its own settings). Returns the new value."""
    visible = visible_devices()
    value = ",".join(visible[index] if visible is not None else str(index) for index in selection)
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    return value


def select_serving_gpus(selection: Sequence[int], ranks: int) -> None:
    """`flare run --gpus`: the list must name one GPU per local rank of the package, each visible; CUDA
    visibility is then narrowed to them before the serving driver starts."""
    shown = format_gpus(selection)
    if len(selection) != ranks:
        raise UsageError(f"--gpus {shown} selects {len(selection)} GPU{'s' if len(selection) != 1 else ''}; "
                         f"the model serves {ranks} local rank{'s' if ranks != 1 else ''}, one GPU each: give "
                         f"{ranks} index{'es' if ranks != 1 else ''}, such as --gpus {format_gpus(range(ranks))}")
    devices = _read_nvml()
    if not devices:
        raise UsageError(f"--gpus {shown}: no CUDA GPU is visible; omit --gpus to serve on the CPU")
    check_gpu_selection(selection, len(devices))
    narrow_visible_devices(selection)


# ----------------------------------------------------------------------------------------------------
# What the device has
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceMemory:
    """Free and total memory of one selected device, read before CUDA starts."""

    index: int                # relative to CUDA_VISIBLE_DEVICES
    name: str
    free: int
    total: int
    host: bool = False        # sized against host memory (no CUDA device)


def read_device_memory() -> list[DeviceMemory]:
    """Every visible GPU's memory through NVML; host memory (one pseudo-device) where there is none."""
    gpus = _read_nvml()
    return gpus if gpus else [read_host_memory()]


def read_host_memory(meminfo: Path = Path("/proc/meminfo")) -> DeviceMemory:
    fields = {}
    for line in meminfo.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0]) * KiB            # /proc/meminfo counts kB (KiB)
    if "MemTotal" not in fields:
        raise CapacityError(f"cannot read host memory from {meminfo}")
    free = fields.get("MemAvailable", fields.get("MemFree", 0))
    return DeviceMemory(index=0, name="host memory", free=free, total=fields["MemTotal"], host=True)


def _read_nvml() -> list[DeviceMemory]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []                                         # no driver: no GPU
    try:
        handles = _visible_handles(pynvml)
        devices = []
        for index, handle in enumerate(handles):
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            devices.append(DeviceMemory(index=index, name=name, free=int(info.free), total=int(info.total)))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _visible_handles(pynvml) -> list:
    """NVML handles in CUDA's visible order. CUDA_VISIBLE_DEVICES entries are indices or UUIDs; an
    entry CUDA cannot parse ends the list there, as CUDA itself does."""
    visible = visible_devices()
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    handles = []
    for entry in visible:
        try:
            if entry.isdigit():
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(entry)))
            else:
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(entry))
        except pynvml.NVMLError:
            break
    return handles


# ----------------------------------------------------------------------------------------------------
# What Flare may use
# ----------------------------------------------------------------------------------------------------

def engine_headroom(phase: Literal["preparation", "serving"], prefill_tokens: int = 0) -> int:
    """Memory Flare keeps free for itself: preparation needs room for compiled warm-up and capture
    (1 GiB, plus 128 KiB per effective prefill token above 4,096); serving, whose graphs and scratch are
    costed separately, 2 GiB for the CUDA context, allocator fragmentation and workspaces."""
    if phase == "serving":
        return SERVING_HEADROOM
    extra_tokens = max(0, prefill_tokens - HEADROOM_FREE_PREFILL_TOKENS)
    return PREPARATION_HEADROOM + extra_tokens * HEADROOM_PER_PREFILL_TOKEN


@dataclass(frozen=True)
class Budget:
    """What one device offers Flare: free memory (or an occupied cap) less headroom and reserve."""

    free: int
    total: int
    headroom: int
    reserve: int = 0                        # left free for processes started later
    occupied_cap: int | None = None         # --memory-limit 30G or 0.8
    reserve_setting: str = "[memory] reserve"   # where the reserve came from, for the options
    host: bool = False

    @property
    def limited_by_cap(self) -> bool:
        return self.occupied_cap is not None and self.occupied_cap < self.free

    @property
    def available(self) -> int:
        """Bytes Flare may occupy, after headroom; may be negative."""
        supply = min(self.free, self.occupied_cap) if self.occupied_cap is not None else self.free
        return supply - self.headroom - self.reserve


def memory_budget(device: DeviceMemory, headroom: int, limit: MemoryLimit | None = None,
                  reserve: int = 0) -> Budget:
    """The budget on one device. An explicit --memory-limit replaces the reserve (configured or
    recorded in the package); the two are never subtracted together."""
    if limit is None:
        return Budget(device.free, device.total, headroom, reserve=reserve, host=device.host)
    if limit.kind == "reserve":
        return Budget(device.free, device.total, headroom, reserve=limit.size,
                      reserve_setting="--memory-limit", host=device.host)
    return Budget(device.free, device.total, headroom, occupied_cap=limit.occupied_cap(device.total),
                  reserve_setting="--memory-limit", host=device.host)


# ----------------------------------------------------------------------------------------------------
# How many KV pages
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowPool:
    """The window pages of a cache with a "window" page kind (flare.models.cache_spec: DeepSeek V4's sliding
    keys and compressor inputs), kept beside the KV pages: `pages_per_request` for each active request and
    `fixed_pages` for a step's prompt tokens (CacheSpec.window_pages_for), plus one page padded rows write."""

    page_bytes: int = 0
    pages_per_request: int = 0
    fixed_pages: int = 0
    retention: int = 0        # tokens before its first position a step reads from them (EngineConfig.window_retention)

    def pages(self, max_concurrency: int) -> int:
        if not self.page_bytes:
            return 0
        return max_concurrency * self.pages_per_request + self.fixed_pages

    def bytes(self, max_concurrency: int) -> int:
        return (self.pages(max_concurrency) + 1) * self.page_bytes if self.page_bytes else 0


@dataclass(frozen=True)
class FixedCosts:
    """Per-device bytes that come before KV pages (declared before loading, observed after)."""

    weights: int
    graphs: int               # graphs and scratch
    live_state: int
    prefix_cache_floor: int
    window_pages: int = 0     # a cache's window pages (WindowPool.bytes)

    @property
    def total(self) -> int:
        return self.weights + self.graphs + self.live_state + self.prefix_cache_floor + self.window_pages


@dataclass(frozen=True)
class KVGeometry:
    page_size: int            # tokens per page
    bytes_per_token: int      # K and V of every layer on one device
    max_context: int          # prepared context ceiling (prompt + generated tokens)
    max_concurrency: int

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclass(frozen=True)
class RequestFloor:
    """The KV tokens memory mode guaranteed each active request at startup, and why (see
    MEMORY_MODE_MIN_TOKENS_PER_REQUEST)."""

    tokens: int
    concurrency: int
    pool_tokens: int

    @property
    def narrowed(self) -> bool:
        return self.tokens < MEMORY_MODE_MIN_TOKENS_PER_REQUEST

    def describe(self) -> str:
        if not self.narrowed:
            return f"{self.tokens:,} tokens per active request (the specification's floor)"
        wide = self.concurrency * MEMORY_MODE_MIN_TOKENS_PER_REQUEST
        return (f"{self.tokens:,} tokens per active request, narrowed from "
                f"{MEMORY_MODE_MIN_TOKENS_PER_REQUEST:,}: {self.concurrency} × "
                f"{MEMORY_MODE_MIN_TOKENS_PER_REQUEST:,} = {wide:,} tokens exceed the pool's "
                f"{self.pool_tokens:,}; a full pool makes admission wait and preempts by recomputation")


@dataclass(frozen=True)
class KVPool:
    pages: int
    page_size: int
    bytes: int
    limited_by: Literal["memory", "context ceiling", "concurrency ceiling"]
    floor: RequestFloor | None = None       # memory mode only

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def describe(self) -> str:
        return (f"{self.pages:,} pages × {self.page_size} tokens = {self.tokens:,} KV tokens "
                f"({self.bytes / GiB:.1f} GiB), limited by {self.limited_by}")


@dataclass(frozen=True)
class PoolMinimum:
    pages: int
    text: str                   # what it is made of, for the section-6 message: "4 × 8,192 tokens"


def pool_minimum(geometry: KVGeometry, kv_cache_limit: KVCacheLimit) -> PoolMinimum:
    """The smallest pool startup accepts. Memory mode: 8,192 tokens per active request, or, if that is
    less, 1,024 per request and one whole prepared context (the width rule); a capped pool: one page per
    active request."""
    concurrency = geometry.max_concurrency
    if kv_cache_limit != "memory":
        return PoolMinimum(concurrency, f"{concurrency} × {geometry.page_size} tokens")
    wide = concurrency * geometry.pages_for(MEMORY_MODE_MIN_TOKENS_PER_REQUEST)
    narrow = concurrency * geometry.pages_for(NARROWEST_TOKENS_PER_REQUEST)
    context = geometry.pages_for(geometry.max_context)
    if wide <= max(narrow, context):
        return PoolMinimum(wide, f"{concurrency} × {MEMORY_MODE_MIN_TOKENS_PER_REQUEST:,} tokens")
    if narrow >= context:
        return PoolMinimum(narrow, f"{concurrency} × {NARROWEST_TOKENS_PER_REQUEST:,} tokens")
    return PoolMinimum(context, f"one {geometry.max_context:,}-token context")


def minimum_pages(geometry: KVGeometry, kv_cache_limit: KVCacheLimit) -> int:
    return pool_minimum(geometry, kv_cache_limit).pages


def request_floor(pages: int, geometry: KVGeometry) -> RequestFloor:
    """Memory mode's floor for a pool of `pages` that met its minimum: 8,192 tokens per active request
    where the pool backs that, else the pool's even share (at least 1,024)."""
    share = pages // geometry.max_concurrency * geometry.page_size
    return RequestFloor(tokens=min(share, MEMORY_MODE_MIN_TOKENS_PER_REQUEST), concurrency=geometry.max_concurrency,
                        pool_tokens=pages * geometry.page_size)

