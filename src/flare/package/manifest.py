"""The signed manifest's schema: what a package records, as frozen types decoded strictly.

`Manifest.from_json(text)` decodes the signed text into these types and refuses, naming the field, a
manifest with a missing, renamed, unknown or mistyped field, or an unsafe name. `Manifest.to_json()` is
the canonical text that is signed: JSON with sorted keys, no spaces, UTF-8 kept, exactly as the first
format-2 packages wrote it, so their signatures still verify and their text round-trips unchanged.
Optional fields added since those packages (a weight payload's `tensors` and `sample`,
`promoted_from`, and the plan's `step_costs`) are left out of the text when absent; a package without
the weight records opens with fewer checks, and says so; one without step costs is scheduled with one
prefill chunk beside decodes.

What each side may assume: a reader holding a `Manifest` has a well-formed one (every payload name
a plain relative path, every hash 64 lowercase hex digits, every deployment rank naming module-global
payloads the manifest lists). Whether its bytes are authentic is the signature's business
(`trust.verify_signature`), whether the payloads match it is `verify`'s.

The checkpoint's `config.json` travels as an opaque mapping (`Checkpoint.config`):
`flare.models.ModelConfig.from_hf_config` types it where the model is built. Dict fields are not to
be mutated; build a changed manifest with `msgspec.structs.replace`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec

from flare.errors import PreparationError
from flare.package.store import model_key_for

FORMAT_VERSION = 2

Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Number = int | float                       # JSON numbers keep their written form (1 stays 1, 1.0 stays 1.0)
PayloadKind = Literal["weights", "frontend", "module-global"]
ServingDtype = Literal["float32", "bfloat16", "float16"]

PRIMARY_NAME = "model.safetensors"
# Payload names are relative paths of plain segments: a manifest can never point outside its entry.
_PAYLOAD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ManifestError(PreparationError):
    """A manifest that does not follow the schema (exit 5): the package is malformed."""


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every manifest record: immutable, strict, optional fields left out when absent."""


def is_plain_payload_name(name: str) -> bool:
    return bool(_PAYLOAD_NAME.fullmatch(name)) and ".." not in name.split("/") and name != PRIMARY_NAME


class TensorRecord(_Record):
    """One tensor of a weight payload as its safetensors header records it. Payload tensors are
    contiguous and row-major, so dtype and shape also fix the strides."""

    name: str
    dtype: str                              # safetensors code: F32, BF16, F8_E4M3, ...
    shape: tuple[Count, ...]
    data_offsets: tuple[Count, Count]       # [start, end) within the payload's data section


class PayloadSample(_Record):
    """A cheap check of a payload's bytes, computed at export and checked on every load: the SHA-256
    of `blocks` blocks of `block_bytes` spread evenly from the payload's first byte to its last
    (`flare.package.verify.sampled_ranges`); of the whole payload when it is no larger than that."""

    block_bytes: Positive
    blocks: Positive
    sha256: Sha256


class PayloadRecord(_Record):
    name: str
    kind: PayloadKind
    sha256: Sha256
    size: Count
    tensors: tuple[TensorRecord, ...] | None = None      # weight payloads: the header's tensor list
    sample: PayloadSample | None = None                  # weight payloads: the sampled hash

    def __post_init__(self) -> None:
        if not is_plain_payload_name(self.name):
            raise ValueError(f"names a payload {self.name!r} that is not a plain relative path")


class Recipe(_Record):
    name: str | None
    alias: str | None


class Checkpoint(_Record):
    repo_id: str | None
    revision: str | None
    config: dict[str, Any]                  # the checkpoint's config.json, opaque here


Milliseconds = Annotated[float, msgspec.Meta(gt=0)]


class StepCostTable(_Record):
    """Engine steps timed at export on the device (`flare.engine.step_cost`): milliseconds[i][j] is one
    step with decode_batches[i] decoding requests (each at decode_context tokens of context) and
    prompt_tokens[j] prompt tokens beside them; long_decode_ms[i] the decodes alone at long_context. The
    `balanced` policy sizes prompt work from it."""

    device: str                             # the GPU it was measured on, as CUDA names it
    decode_context: Positive
    decode_batches: tuple[Positive, ...]
    prompt_tokens: tuple[Count, ...]
    milliseconds: tuple[tuple[Milliseconds, ...], ...]
    long_context: Count = 0                 # 0 (and older packages): decodes timed at decode_context only
    long_decode_ms: tuple[Milliseconds, ...] = ()   # decode_batches[i] decodes alone at long_context each

    def __post_init__(self) -> None:
        if len(self.milliseconds) != len(self.decode_batches) or any(
                len(row) != len(self.prompt_tokens) for row in self.milliseconds):
            raise ValueError(f"step_costs.milliseconds must be {len(self.decode_batches)} rows of "
                             f"{len(self.prompt_tokens)} times")
        for name in ("decode_batches", "prompt_tokens"):
            values = list(getattr(self, name))
            if not values or values != sorted(set(values)):
                raise ValueError(f"step_costs.{name} {values} must be distinct and rising")
        if self.prompt_tokens[0] != 0:
            raise ValueError("step_costs.prompt_tokens must start at 0 (decodes alone)")
        if (self.long_context or self.long_decode_ms) and (
                self.long_context <= self.decode_context or len(self.long_decode_ms) != len(self.decode_batches)):
            raise ValueError(f"step_costs.long_context {self.long_context} must exceed decode_context "
                             f"{self.decode_context}, with one long_decode_ms per decode batch")


class SpeculationProgram(_Record):
    """One verification program of a speculative catalog (spec §3.1 B/D/W/P): `batch` requests (the
    decode capacity), `drafts` drafts each, `width` = drafts + 1 target rows per request, `rows` =
    batch x width target rows in all. Width one (ordinary decoding) is never listed: every batch has it."""

    batch: Positive
    drafts: Positive
    width: Positive
    rows: Positive


DRAFT_WEIGHTS = "weights/draft/"           # the payloads of a learned draft's weights


class DraftModel(_Record):
    """A learned draft whose weights are this package's `weights/draft/` payloads."""

    kind: Literal["model", "eagle3"]        # a small model sharing the target's tokenizer, or an EAGLE-3 head
    repo_id: str | None                     # where it came from (None: supplied in the checkpoint's draft/)
    revision: str | None
    config: dict[str, Any]                  # its config.json, opaque here


class SpeculationPlan(_Record):
    """Speculative decoding as prepared: `flare run` reduces it within these capacities, never beyond."""

    draft_tokens: Count                     # most drafts per request and round (--mtp-draft-tokens)
    adaptive: bool                          # the verification policy serving defaults to
    token_capacity: Positive                # most target rows of a verification step (--speculative-token-capacity)
    history: bool                           # drafts can be copied from each request's decoded history
    programs: tuple[SpeculationProgram, ...]
    draft: DraftModel | None = None         # None: drafts come from history only


class Plan(_Record):
    """What preparation decided and serving follows."""

    dtype: ServingDtype
    page_size: Positive
    prefill_chunk: Positive
    compile: bool                           # False: --no-compile (eager decoder layers)
    max_concurrency: Positive
    decode_capacities: tuple[Positive, ...]
    max_model_len: Positive | None
    memory_reserve_bytes: Count
    tensor_parallel: Positive
    # --online-mxfp8: the decoder projections (checkpoint names, e.g. q_proj) stored as FP8 e4m3 with a
    # float32 scale per 128x128 block (flare.models.quantization); empty: stored as the checkpoint has them
    online_fp8: tuple[str, ...] = ()
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"    # --kv-cache-dtype
    step_costs: StepCostTable | None = None    # measured at export on a GPU; None: not measured
    # Token-count buckets of prompt-carrying and mixed steps that serving captures as piecewise graphs
    # (flare.engine.prompt_graphs); set only when export captured them on the GPU and their replays
    # matched the eager step. Empty: those steps run eagerly.
    prompt_graph_sizes: tuple[Positive, ...] = ()
    # The device memory that capture took at export (its peak over what the device held before): serving
    # sets it aside before sizing KV pages, since the graphs are captured after the pages are allocated.
    prompt_graph_bytes: Count = 0
    speculation: SpeculationPlan | None = None      # None: --no-mtp, or a package from before speculation
    # The kernel of prompt attention over bf16/fp16 caches, chosen by measurement at export
    # (flare.engine.prompt_kernel): Flare's Triton kernel, or FlashInfer's FA3 kernel on Hopper GPUs.
    prefill_attention: Literal["triton", "flashinfer-fa3"] = "triton"


class Sampling(_Record):
    defaults: dict[str, Number]
    ranges: dict[str, tuple[Number, Number]]


class License(_Record):
    name: str
    link: str | None


class Publisher(_Record):
    namespace: str
    official_source: str
    key_fingerprint: Sha256


class PromotedFrom(_Record):
    """Set by `ignition sign`: the development version this one re-signs."""

    version: str
    key_fingerprint: Sha256


class PhaseRecord(_Record):
    phase: str
    status: str
    detail: str
    elapsed_s: float


class Preparation(_Record):
    device: str
    phases: tuple[PhaseRecord, ...]


class Frontend(_Record):
    payload: str
    assets: tuple[str, ...]


class Rank(_Record):
    rank: Count
    payloads: tuple[str, ...]


class Deployment(_Record):
    name: str
    tensor_parallel: Positive
    ranks: tuple[Rank, ...]


class GraphCatalog(_Record):
    """A rank's graph catalog, the metadata of its module-global payload (not part of the manifest)."""

    captured: tuple[Positive, ...]
    note: str
    prompt_tokens: tuple[Positive, ...] = ()    # the plan's prompt_graph_sizes
    prompt_note: str = ""                       # what export's check of the prompt graphs found

    @classmethod
    def from_json(cls, text: str, where: str) -> "GraphCatalog":
        return _decode(text, cls, f"the graph catalog of {where}")

    def to_json(self) -> str:
        return json.dumps(msgspec.to_builtins(self), sort_keys=True)


class Manifest(_Record):
    format_version: int
    model_key: str
    version: str
    model_id: str
    served_names: tuple[str, ...]
    recipe: Recipe
    checkpoint: Checkpoint
    repository: str | None
    plan: Plan
    sampling: Sampling
    license: License | None
    publisher: Publisher
    created: str
    preparation: Preparation
    frontend: Frontend
    deployments: tuple[Deployment, ...]
    payloads: tuple[PayloadRecord, ...]
    promoted_from: PromotedFrom | None = None

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version is {self.format_version}; this Flare reads format {FORMAT_VERSION}")
        if not _VERSION.fullmatch(self.version):
            raise ValueError(f"version {self.version!r} is not a plain name")
        if self.model_key != model_key_for(self.model_id):
            raise ValueError(f"model_key {self.model_key!r} does not match model_id {self.model_id!r}")
        kinds = {record.name: record.kind for record in self.payloads}
        if len(kinds) != len(self.payloads):
            raise ValueError("payloads names one payload more than once")
        if kinds.get(self.frontend.payload) != "frontend":
            raise ValueError(f"frontend.payload {self.frontend.payload!r} is not a frontend payload it lists")
        for deployment in self.deployments:
            for rank in deployment.ranks:
                for name in rank.payloads:
                    if kinds.get(name) != "module-global":
                        raise ValueError(f"deployment {deployment.name} rank {rank.rank} names {name!r}, "
                                         "which is not a module-global payload it lists")

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        return _decode(text, cls, "the signed manifest")

    def to_json(self) -> str:
        """The canonical text: the bytes that are signed."""
        return canonical_text(msgspec.to_builtins(self))

    def to_builtins(self) -> dict:
        return msgspec.to_builtins(self)

    @property
    def label(self) -> str:
        return f"{self.model_key}@{self.version}"

    def weight_payloads(self) -> tuple[PayloadRecord, ...]:
        return tuple(record for record in self.payloads if record.kind == "weights")

    def payloads_of_kind(self, *kinds: str) -> tuple[PayloadRecord, ...]:
        return tuple(record for record in self.payloads if record.kind in kinds)

    def payload(self, name: str) -> PayloadRecord:
        return next(record for record in self.payloads if record.name == name)


def canonical_text(builtins: dict) -> str:
    """The canonical JSON text of a manifest's plain-data form (sorted keys, compact, UTF-8 kept)."""
    return json.dumps(builtins, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _decode(text: str | bytes, kind: type, what: str):
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as error:
        raise ManifestError(f"{what} is malformed: {error}; export or download the package again") from None
    except msgspec.DecodeError as error:
        raise ManifestError(f"{what} is corrupt ({error}); export or download the package again") from None
