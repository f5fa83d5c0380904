"""The cadence bound a served model keeps: the balanced policy with the step costs its package measured.

`flare.engine.policy` says what the bound does. Here it is chosen for one served model: the bound from
`--scheduler-max-step-ms`, then `[scheduler] max_step_ms`, then the default (twice the package's measured
step of a full decode batch), and the costs only where they describe this device: recorded at export
(`Plan.step_costs`) on a GPU of the same name. Without usable costs, balanced serving carries one prefill
chunk beside decoding requests, as before there were costs, and a bound given for it is refused, since it
could not be kept; so is a bound given with `--scheduler-policy throughput`, which keeps none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flare.engine.policy import DEFAULT_CADENCE_FACTOR, SchedulerPolicy
from flare.engine.step_cost import StepCosts
from flare.errors import UsageError
from flare.memory import read_device_memory


@dataclass(frozen=True)
class Cadence:
    policy: SchedulerPolicy
    note: str                   # for the startup report: the bound, or why there is none


def step_costs_of(plan: Any) -> StepCosts | None:
    """The engine's step costs from a package plan's record (`flare.package.manifest.StepCostTable`)."""
    table = plan.step_costs
    if table is None:
        return None
    return StepCosts(table.device, table.decode_context, table.decode_batches, table.prompt_tokens,
                     table.milliseconds, table.long_context, table.long_decode_ms)


def serving_cadence(policy: SchedulerPolicy | None, costs: StepCosts | None, concurrency: int, prefill_chunk: int,
                    flag: float | None, config: Any, packaged: bool = True) -> Cadence:
    """The policy the engine runs with, its cadence bound settled; UsageError for a bound that cannot be kept.
    `packaged` False: a checkpoint served without a package (debug-serve), which has no step costs."""
    from flare.config import MAX_STEP_MS, resolve

    policy = policy or SchedulerPolicy()
    chosen = resolve(MAX_STEP_MS, flag, config)
    if policy.name != "balanced":
        if chosen.value is not None:
            raise UsageError(f"{chosen.origin}: a cadence bound applies to --scheduler-policy balanced; "
                             f"{policy.name} keeps none (it lets prompt bursts through); remove one of the two")
        return Cadence(policy, "no cadence bound (prompt bursts fill the step)")
    missing = _unusable(costs, packaged)
    if missing:
        if chosen.value is not None:
            raise UsageError(f"{chosen.origin}: a cadence bound needs the step costs measured at export, and "
                             f"{missing}; export the package on this GPU, or remove the setting")
        return Cadence(policy, f"one prefill chunk ({prefill_chunk:,} tokens) beside decoding requests: {missing}")
    bounded = policy.with_step_costs(costs, concurrency, chosen.value, chosen.origin)
    where = (chosen.origin if chosen.value is not None
             else f"the default, {DEFAULT_CADENCE_FACTOR:g} × the {concurrency}-request decode step")
    return Cadence(bounded, f"steps beside decoding requests kept within {bounded.max_step_ms:g} ms ({where}; "
                            f"step costs measured at export on {costs.device})")


def _unusable(costs: StepCosts | None, packaged: bool) -> str | None:
    """Why the package's step costs do not describe this device, or None when they do."""
    if costs is None:
        return ("the package records no step costs (it was exported without a GPU)" if packaged
                else "a checkpoint served without a package has no step costs (export measures them)")
    device = read_device_memory()[0]
    if device.host:
        return f"serving on the CPU, and the step costs were measured on {costs.device}"
    if device.name.strip().casefold() != costs.device.strip().casefold():
        return f"the step costs were measured on {costs.device}, and this GPU is {device.name}"
    return None
