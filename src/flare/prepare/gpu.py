"""Export's GPU half: the checkpoint loaded onto the GPU, compiled, its decode catalog captured, warmed up,
its prompt graphs captured and checked, its steps timed, and what was compiled kept for the package
(flare.engine.compile_cache packs it; `flare run` loads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flare.engine.compile_cache import CompiledArtifacts, save_artifacts

if TYPE_CHECKING:
    from flare.engine.prompt_graphs import PromptGraphCheck
    from flare.engine.step_cost import StepCosts
    from flare.package.manifest import Plan


@dataclass(frozen=True)
class PreparedCode:
    artifacts: CompiledArtifacts | None
    captured_sizes: tuple[int, ...]              # the decode graph catalog the warm-up captured
    seconds: float
    step_costs: StepCosts | None = None          # steps timed after the warm-up (on a GPU)
    step_cost_seconds: float = 0.0
    prompt_graphs: PromptGraphCheck | None = None    # export's check of the prompt graphs (on a GPU)
    prompt_kernel: str = "triton"                # the prompt attention kernel it ran (Plan.prefill_attention)


def prepare_compiled(checkpoint_dir, plan: Plan, device: str = "cuda",
                     compile_workers: int | None = None) -> PreparedCode:
    """Load the checkpoint onto the GPU, compile it (unless the plan says `compile: False`), capture the
    plan's decode catalog, run a warm-up request, capture and check the prompt graphs
    (flare.engine.prompt_graphs), time the engine's steps through them when they passed
    (flare.engine.step_cost, on a GPU), and keep what was compiled. `compile_workers` bounds Inductor's
    compiler processes. Frees the GPU memory it used before returning."""
    import gc
    import time
    from dataclasses import replace

    import torch

    from flare.engine.config import PageSupply, engine_config_for_pool
    from flare.engine.factory import build_core, load_checkpoint_model
    from flare.engine.prompt_graphs import pages_to_check
    from flare.engine.prompt_kernel import TRITON, use_prompt_kernel
    from flare.engine.step_cost import measurement_model_len
    from flare.engine.warm_up import WARM_UP_SHORT_PROMPT, warm_up, warm_up_prompt_tokens

    started = time.perf_counter()
    chunk = plan.prefill_chunk
    prompt_tokens = warm_up_prompt_tokens(chunk, 1 << 30)
    max_model_len = max(prompt_tokens + 2, measurement_model_len(chunk))
    pages = -(-max_model_len // plan.page_size) + -(-(WARM_UP_SHORT_PROMPT + 2) // plan.page_size)
    prompt_sizes = plan_prompt_graph_sizes(checkpoint_dir, plan)
    pages = max(pages, pages_to_check(prompt_sizes[-1], plan.page_size))
    config = engine_config_for_pool(PageSupply(pages, plan.page_size), max_concurrency=plan.max_concurrency,
                                    prepared_context=max_model_len, prefill_chunk=chunk,
                                    enable_prefix_caching=False, decode_graph_sizes=plan.decode_capacities)
    if compile_workers is not None:
        import torch._inductor.config as inductor

        inductor.compile_threads = compile_workers
    loaded = load_checkpoint_model(checkpoint_dir, config, device, plan.dtype, online_fp8=plan.online_fp8,
                                   kv_cache_dtype=plan.kv_cache_dtype)
    loaded = replace(loaded, compile_layers=plan.compile)
    prompt_kernel = use_prompt_kernel(loaded.model, plan.prefill_attention, device, getattr(torch, plan.dtype)).kernel
    core = build_core(loaded)
    graphs = core.runner.graphs
    sizes = graphs.sizes if graphs is not None else ()
    warm_up(core, loaded.model_config.vocab_size, prompt_tokens)
    on_cuda = str(device).startswith("cuda")
    costs, cost_seconds, prompt_check = None, 0.0, None
    if on_cuda:
        prompt_check = check_runner_prompt_graphs(core.runner, prompt_sizes) if graphs is not None else None
        costs, cost_seconds = _measure_steps(core.runner, device)
    artifacts = save_artifacts(prompt_kernel != TRITON) if on_cuda else None      # nothing is compiled for a CPU
    if prompt_check is not None:
        prompt_check = replace(prompt_check, graphs=None)   # their memory goes with the core's
    del core, graphs, loaded
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return PreparedCode(artifacts, tuple(sizes), time.perf_counter() - started - cost_seconds, costs, cost_seconds,
                        prompt_check, prompt_kernel)


def plan_prompt_graph_sizes(checkpoint_dir, plan: Plan) -> tuple[int, ...]:
    """The prompt-graph buckets export captures for `plan`: its step budget's, the larger FP8 set when the
    checkpoint or the plan puts projections in FP8 (flare.engine.config.FP8_PROMPT_GRAPH_BUCKETS)."""
    from flare.engine.config import prompt_graph_sizes, step_token_budget
    from flare.models.loader import read_model_config

    fp8_projections = read_model_config(checkpoint_dir, plan.online_fp8).fp8 is not None
    return prompt_graph_sizes(step_token_budget(plan.prefill_chunk, plan.max_concurrency), fp8_projections)


def _measure_steps(runner, device: str):
    """(the runner's step costs, the seconds their measurement took), on a GPU."""
    import time

    import torch

    from flare.engine.step_cost import measure_step_costs

    started = time.perf_counter()
    costs = measure_step_costs(runner, torch.cuda.get_device_name(torch.device(device)))
    torch.cuda.synchronize()
    return costs, time.perf_counter() - started


def check_runner_prompt_graphs(runner, sizes: tuple[int, ...]) -> PromptGraphCheck:
    """Capture and check the prompt graphs of `sizes` on the runner's model and caches; when they pass,
    the runner replays its prompt-carrying steps through them from here on (so the step costs measured
    next are those serving will see)."""
    from flare.engine.prompt_graphs import check_prompt_graphs

    config = runner.config
    check = check_prompt_graphs(runner.model, runner.kv_caches, sizes, range(config.num_pages), config.page_size,
                                runner.vocab_size)
    runner.use_prompt_graphs(check.graphs)
    return check
