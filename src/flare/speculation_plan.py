"""Speculative decoding's settings as the spec's flags and keys give them (§3.1, §3.2, §3.3); no torch.

Preparation: the recipe's declaration (`recipes.base.Speculation`), the preparation flags and the file's
`speculative_token_capacity` make the plan's record (`plan_speculation` -> `SpeculationPlan`), with its
catalog of verification programs (B/D/W/P: `catalog_programs`). Serving: that record and the serving
flags make the engine's `SpeculationSettings` (`serving_speculation`); serving reduces what was prepared,
never extends it, and refuses by name what the package cannot do.

The catalogs here are rectangular: every decode capacity B holds each draft count D = 1 .. N whose
aggregate rows B x (D + 1) fit the speculative token capacity, beside width one (ordinary decoding),
which every batch has. Packed catalogs (the spec's graph budget) belong to recipes none of which are
served here, so `--speculative-graph-budget` and a model-specific `speculative_graph_budget` are refused
by name, and a `[defaults]` budget is ignored, as the spec says for recipes it does not apply to.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from flare.config import SPECULATIVE_GRAPH_BUDGET, SPECULATIVE_TOKEN_CAPACITY, resolve
from flare.engine.speculation.settings import supplied_draft
from flare.errors import UsageError
from flare.package.manifest import SpeculationPlan, SpeculationProgram


@dataclass(frozen=True)
class PreparationFlags:
    """`ignition export` / `debug-serve`'s speculation flags; None: not given."""

    no_mtp: bool = False
    draft_tokens: int | None = None             # --mtp-draft-tokens
    token_capacity: int | None = None           # --speculative-token-capacity
    graph_budget: int | None = None             # --speculative-graph-budget
    fixed_verification: bool = False            # --no-mtp-adaptive-verification

    def given(self) -> list[str]:
        """The speculation flags given explicitly, as typed."""
        return [flag for flag, value in (("--mtp-draft-tokens", self.draft_tokens),
                                         ("--speculative-token-capacity", self.token_capacity),
                                         ("--speculative-graph-budget", self.graph_budget),
                                         ("--no-mtp-adaptive-verification", self.fixed_verification or None))
                if value is not None]


@dataclass(frozen=True)
class ServingFlags:
    """`flare run`'s speculation flags; None: not given (the package's default applies)."""

    draft_tokens: int | None = None             # --mtp-draft-tokens
    adaptive: bool | None = None                # --mtp-adaptive-verification / --no-mtp-adaptive-verification
    history: bool | None = None                 # --history-drafts / --no-history-drafts
    alpha: float | None = None                  # --mtp-adaptive-verification-alpha
    exact_budget: int | None = None             # --mtp-verification-token-budget
    max_budget: int | None = None               # --mtp-max-verification-token-budget


def catalog_programs(capacities: Iterable[int], draft_tokens: int, token_capacity: int) -> tuple[SpeculationProgram, ...]:
    """The rectangular catalog: each batch capacity with every draft count its rows allow."""
    return tuple(SpeculationProgram(batch, drafts, drafts + 1, batch * (drafts + 1))
                 for batch in capacities for drafts in range(1, draft_tokens + 1)
                 if batch * (drafts + 1) <= token_capacity)


def plan_speculation(declared, flags: PreparationFlags, config: Any, names: Iterable[str],
                     decode_capacities: tuple[int, ...], model: str, draft=None) -> SpeculationPlan | None:
    """The plan's speculation record for a recipe's declaration (`recipes.base.Speculation`) and the flags;
    None under --no-mtp. `model` names the checkpoint in messages (its alias); `draft` is the learned
    draft the preparation brings (`manifest.DraftModel`), kept even at 0 draft tokens (its state stays)."""
    names = tuple(name for name in names if name)
    _refuse_graph_budget(flags, config, names)
    if flags.no_mtp:
        given = [flag for flag in flags.given() if flag != "--speculative-graph-budget"]
        if given:
            raise UsageError(f"--no-mtp excludes {given[0]}: --no-mtp prepares no draft and no verification; "
                             f"drop one of the two")
        return None
    if not declared.available:
        if flags.given():
            raise UsageError(f"{flags.given()[0]}: {model} has no speculative decoding ({declared.note})")
        return None
    draft_tokens = declared.default_draft_tokens if flags.draft_tokens is None else flags.draft_tokens
    if not 0 <= draft_tokens <= declared.max_draft_tokens:
        raise UsageError(f"--mtp-draft-tokens {draft_tokens} is outside {model}'s range 0 through "
                         f"{declared.max_draft_tokens} (see `ignition export {model} --help`)")
    capacity = resolve(SPECULATIVE_TOKEN_CAPACITY, flags.token_capacity, config, declared.token_capacity, names=names)
    programs = catalog_programs(decode_capacities, draft_tokens, capacity.value)
    if draft_tokens and not programs:
        raise UsageError(f"{capacity.origin} holds no verification round: one request with one draft needs "
                         f"2 target rows; raise it to at least 2, or prepare with --mtp-draft-tokens 0")
    return SpeculationPlan(draft_tokens=draft_tokens, adaptive=not flags.fixed_verification,
                           token_capacity=capacity.value, history=declared.history, programs=programs, draft=draft)


def _refuse_graph_budget(flags: PreparationFlags, config: Any, names: tuple[str, ...]) -> None:
    """A packed graph budget given where it would apply (a flag, a model's section) is refused: no recipe
    here has a packed catalog. A [defaults] budget applies only to packed recipes: ignored (spec §3.3)."""
    chosen = resolve(SPECULATIVE_GRAPH_BUDGET, flags.graph_budget, config, None, names=names)
    if chosen.source == "flag" or (chosen.source == "config" and chosen.origin.startswith("models.")):
        raise UsageError(f"{chosen.origin}: the speculative graph budget sizes packed round catalogs, which "
                         "need packed adaptive learned speculation; the recipes here have rectangular "
                         "catalogs (every width within --speculative-token-capacity); remove it")


def serving_speculation(plan: SpeculationPlan | None, flags: ServingFlags, draft_model: bool = False):
    """The engine's `SpeculationSettings` for a package's record and `flare run`'s flags."""
    from flare.engine.speculation.settings import SpeculationSettings

    if plan is None:
        asked = _positive_requests(flags)
        if asked:
            raise UsageError(f"{asked[0]} needs speculation, and this package was prepared without it (--no-mtp, "
                             "or by a version that recorded none); export it again without --no-mtp")
        return SpeculationSettings()
    draft_tokens = plan.draft_tokens if flags.draft_tokens is None else flags.draft_tokens
    if not 0 <= draft_tokens <= plan.draft_tokens:
        raise UsageError(f"--mtp-draft-tokens {draft_tokens} is outside the package's prepared 0 through "
                         f"{plan.draft_tokens}; choose {plan.draft_tokens} or less, or export again with "
                         f"--mtp-draft-tokens {draft_tokens}")
    if draft_tokens and not any(program.drafts == draft_tokens for program in plan.programs):
        raise UsageError(f"--mtp-draft-tokens {draft_tokens}: the package captured no verification of "
                         f"{draft_tokens} drafts within its {plan.token_capacity} target rows")
    history = bool(flags.history)           # packages record no history preference: off unless asked
    if history and not plan.history:
        raise UsageError("--history-drafts: this package's recipe cannot copy drafts from decoded history")
    if history and draft_tokens == 0:
        raise UsageError("--history-drafts needs speculation, and --mtp-draft-tokens 0 selects ordinary decoding")
    adaptive = plan.adaptive if flags.adaptive is None else flags.adaptive
    _check_adaptive_only(flags, adaptive)
    rows = plan.token_capacity if flags.max_budget is None else min(plan.token_capacity, flags.max_budget)
    return SpeculationSettings(draft_tokens=draft_tokens, history=history, draft_model=draft_model,
                               adaptive=adaptive, alpha=1.0 if flags.alpha is None else flags.alpha,
                               max_verification_tokens=rows, exact_verification_tokens=flags.exact_budget)


def _positive_requests(flags: ServingFlags) -> list[str]:
    """The flags that ask for speculation (turning it off needs none)."""
    return [flag for flag, asked in (("--mtp-draft-tokens", bool(flags.draft_tokens)),
                                     ("--history-drafts", bool(flags.history)),
                                     ("--mtp-adaptive-verification", bool(flags.adaptive)),
                                     ("--mtp-adaptive-verification-alpha", flags.alpha is not None),
                                     ("--mtp-verification-token-budget", flags.exact_budget is not None),
                                     ("--mtp-max-verification-token-budget", flags.max_budget is not None))
            if asked]


def _check_adaptive_only(flags: ServingFlags, adaptive: bool) -> None:
    if flags.exact_budget is not None and flags.max_budget is not None:
        raise UsageError("--mtp-verification-token-budget and --mtp-max-verification-token-budget exclude each "
                         "other: keep one")
    if adaptive:
        return
    for flag, value in (("--mtp-adaptive-verification-alpha", flags.alpha),
                        ("--mtp-verification-token-budget", flags.exact_budget),
                        ("--mtp-max-verification-token-budget", flags.max_budget)):
        if value is not None:
            raise UsageError(f"{flag} applies to adaptive verification, and fixed-width verification is "
                             "selected (--no-mtp-adaptive-verification, or the package's default); add "
                             "--mtp-adaptive-verification or drop it")


def speculation_summary(draft_tokens: int | None, adaptive: bool = True, history: bool = False) -> str:
    """The settings in effect, as the Select GPUs. line and the startup report state them (spec §3.1);
    `draft_tokens` None: speculation off."""
    if draft_tokens is None:
        return "speculation off"
    if draft_tokens == 0:
        return "speculation at width one (0 draft tokens)"
    drafts = "draft token" if draft_tokens == 1 else "draft tokens"
    policy = f"up to {draft_tokens} {drafts} while verification adapts" if adaptive else f"exactly {draft_tokens} {drafts}"
    return policy + ("; history drafts on" if history else "")


@dataclass(frozen=True)
class SpeculationMemory:
    scratch: int            # bytes a verification step sets aside beside the decode batch's scratch
    per_request: int        # bytes each active request holds beyond its context: its lookahead page


def speculation_memory(hf_config: dict, concurrency: int, draft_tokens: int, max_rows: int | None,
                       page_size: int, kv_bytes_per_token: int) -> SpeculationMemory:
    """What verification needs, for the section-6 estimate and the serving pool. A verification step
    holds float32 logits and target probabilities for each verified position (at most the capacity's
    rows) and float64 draws over the vocabulary for each request's token after its drafts; each request's
    drafts may write one page past its context (the lookahead page, kept while the request runs: its next
    tokens go there)."""
    if draft_tokens <= 0:
        return SpeculationMemory(0, 0)
    vocab = int(hf_config["vocab_size"])
    rows = concurrency * (draft_tokens + 1)
    if max_rows is not None:
        rows = min(rows, max_rows)
    return SpeculationMemory(scratch=rows * vocab * 2 * 4 + concurrency * vocab * 2 * 8,
                             per_request=page_size * kv_bytes_per_token)


def fetch_draft(declared, checkpoint_dir: Path, hub_options) -> tuple[Path, str | None, str | None] | None:
    """(directory, repository, revision) of the learned draft a preparation uses: the one the checkpoint
    supplies in draft/, else the recipe's declared draft (`recipes.base.Speculation.draft`) from the hub
    cache at its pinned revision, downloaded if needed; None when there is neither."""
    supplied = supplied_draft(checkpoint_dir)
    if supplied is not None:
        return supplied, None, None
    if declared.draft is None:
        return None
    from flare.hub import download_snapshot, resolve_revision

    draft = declared.draft
    commit = resolve_revision(draft.repo_id, draft.revision, hub_options)
    return Path(download_snapshot(draft.repo_id, commit, hub_options)), draft.repo_id, commit
