"""Compiled kernels prepared on a GPU travel in the package's module-global payload and load only where
they fit. The GPU preparation itself is replaced here by its result; the plumbing around it is real."""

from __future__ import annotations

import io

import msgspec
import pytest

from flare import prepare
from flare.engine import compile_cache
from flare.engine import warm_up as warm_up_module
from flare.engine.compile_cache import CompiledArtifacts
from flare.prepare import gpu as prepare_gpu
from flare.prepare.gpu import PreparedCode
from flare.engine.step_cost import StepCosts
from flare.package.manifest import GraphCatalog, Plan
from flare.package.verify import IntegrityError
from flare.package.reader import open_package, open_unverified

KEY = {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "gpu": "NVIDIA H200", "capability": "9.0"}
STEP_COSTS = StepCosts("NVIDIA H200", 1024, (1, 4), (0, 64, 128), ((4.0, 4.5, 5.0), (4.2, 4.8, 5.5)),
                       long_context=4096, long_decode_ms=(4.9, 6.1))


@pytest.fixture
def gpu_prepared(monkeypatch):
    """export_model as on a GPU whose warm-up produced `artifacts` and captured sizes 1, 2, 4."""
    artifacts = CompiledArtifacts(bytes(range(256)) * 64, KEY, b"packed kernels" * 10)

    def prepared(checkpoint_dir, plan, device, progress, compile_workers=None):
        return PreparedCode(artifacts, (1, 2, 4), 1.5, STEP_COSTS, 2.5)

    monkeypatch.setattr(prepare, "_prepare_code", prepared)
    return artifacts


def test_export_stores_the_compiled_artifacts_and_catalog(export, approved, gpu_prepared):
    package = open_package(export(), approved)
    assert CompiledArtifacts(*package.compiled_artifacts()) == gpu_prepared
    assert [catalog.captured for catalog in package.graph_catalogs.values()] == [(1, 2, 4)]
    from flare.server.cadence import step_costs_of

    assert step_costs_of(package.plan) == STEP_COSTS                 # the measured steps, in the signed plan


def test_the_plan_records_the_prompt_kernel_and_its_builds_travel(export, approved, monkeypatch, capsys):
    """An export whose GPU chose FlashInfer's prompt attention: the plan says so, its builds are packed,
    and `flare inspect` shows both."""
    import json

    from flare.cli.flare import main

    artifacts = CompiledArtifacts(b"compiled" * 8, KEY, b"kernels", b"flashinfer builds")

    def prepared(checkpoint_dir, plan, device, progress, compile_workers=None):
        return PreparedCode(artifacts, (1, 2, 4), 1.5, prompt_kernel="flashinfer-fa3")

    monkeypatch.setattr(prepare, "_prepare_code", prepared)
    entry = export()
    package = open_package(entry, approved)
    assert package.plan.prefill_attention == "flashinfer-fa3"
    assert CompiledArtifacts(*package.compiled_artifacts()) == artifacts
    assert main(["inspect", str(entry), "--graphs", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["capacities"]["prefill_attention"] == "flashinfer-fa3"
    assert report["graphs"][0]["compiled"]["flashinfer_build_bytes"] == len(b"flashinfer builds")


def test_a_cpu_export_carries_no_compiled_artifacts(export, approved):
    package = open_package(export(), approved)
    assert package.compiled_artifacts() is None and package.plan.step_costs is None
    assert package.plan.prefill_attention == "triton"
    # The catalog is the plan's: a GPU that serves the package captures exactly these sizes.
    assert list(package.graph_catalogs.values())[0].captured == package.plan.decode_capacities == (1, 2, 4)


def test_tampered_artifacts_are_refused(export, gpu_prepared):
    entry = export()
    payload = entry / "deployments/tp1/rank-0/graphs.safetensors"
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.unlink()                                      # a hard link to the blob: replace, do not edit
    payload.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="graphs.safetensors is corrupt"):
        open_unverified(entry).compiled_artifacts()


def test_artifacts_load_only_where_they_were_made(monkeypatch, tmp_path):
    loaded = []
    monkeypatch.setattr(compile_cache, "environment_key", lambda: dict(KEY, gpu="NVIDIA H100 80GB HBM3"))
    import torch
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    note = compile_cache.load_artifacts(CompiledArtifacts(b"x" * 1024, KEY))
    assert loaded == []
    assert "gpu NVIDIA H200 (here NVIDIA H100 80GB HBM3)" in note and note.endswith("compiling")

    monkeypatch.setattr(compile_cache, "environment_key", lambda: dict(KEY))
    monkeypatch.setattr(compile_cache, "triton_cache_dir", lambda: tmp_path / "triton")
    kernels = _fake_triton_cache(tmp_path / "made", {"_decode_split_kernel": "a1", "_prefill_kernel": "b2"})
    note = compile_cache.load_artifacts(CompiledArtifacts(b"x" * 1024, KEY, kernels))
    assert loaded == [b"x" * 1024] and note.startswith("compiled kernels from the package")
    assert "2 Triton kernels added" in note and sorted(p.name for p in (tmp_path / "triton").iterdir()) == ["a1", "b2"]
    assert compile_cache.load_artifacts(None).endswith("compiling")


def test_gpu_export_reports_the_prepared_phases(export, gpu_prepared, monkeypatch):
    """The phase lines come from the real _prepare_code when the warm-up is stood in for."""
    monkeypatch.undo()
    calls = []

    def prepared_code(directory, plan, device, compile_workers):
        calls.append(compile_workers)
        assert plan.prefill_attention == "flashinfer-fa3"        # the tuned kernel runs the warm-up and steps
        return PreparedCode(gpu_prepared, (1, 2, 4, 8), 12.0, STEP_COSTS, 2.5, prompt_kernel=plan.prefill_attention)

    from flare.engine.prompt_kernel import PromptKernelChoice

    tuned = PromptKernelChoice("flashinfer-fa3", "FlashInfer FA3 prompt attention (Triton / FlashInfer: 9.9 / 6.1 ms)")
    monkeypatch.setattr(prepare, "_choose_prompt_kernel", lambda directory, plan, device: tuned)
    monkeypatch.setattr(prepare_gpu, "prepare_compiled", prepared_code)
    from flare.ui.progress import PhaseProgress
    stream = io.StringIO()
    prepared = prepare._prepare_code(None, _plan(compile=True), "cuda", PhaseProgress(stream=stream, styled=False), 3)
    text = stream.getvalue()
    assert prepared.captured_sizes == (1, 2, 4, 8) and calls == [3]
    assert "Tune kernels. [ OK ] FlashInfer FA3 prompt attention (Triton / FlashInfer: 9.9 / 6.1 ms)" in text
    assert "warmed up in 12.0 s" in text and "4 decode batch sizes (1, 2, 4, 8)" in text
    assert ("Measure steps. [ OK ] 6 step shapes timed in 2.5 s on NVIDIA H200: decode batches 1-4 beside 0-128 "
            "prompt tokens, 4.0-5.5 ms; decodes alone at 4,096 tokens of context 4.9-6.1 ms") in text
    stream = io.StringIO()
    prepare._prepare_code(None, _plan(compile=False), "cuda", PhaseProgress(stream=stream, styled=False))
    assert "Compile forward. [SKIP] --no-compile: eager layers, warmed up in 12.0 s" in stream.getvalue()


def _plan(**fields) -> Plan:
    """A plan for the stand-in GPU preparation; `fields` override its values."""
    values = dict(dtype="float32", page_size=16, prefill_chunk=64, compile=True, max_concurrency=4,
                  decode_capacities=(1, 2, 4), max_model_len=512, memory_reserve_bytes=0, tensor_parallel=1)
    return Plan(**{**values, **fields})


def _fake_triton_cache(root, kernels: dict) -> bytes:
    """A Triton cache with one entry per kernel name (folder name -> files as Triton writes them), packed."""
    for name, folder in kernels.items():
        entry = root / folder
        entry.mkdir(parents=True)
        (entry / f"__grp__{name}.json").write_text("{}")
        (entry / f"{name}.cubin").write_bytes(b"\x7fELF" + folder.encode())
    return compile_cache.pack_triton_kernels(root, set(kernels))


def test_only_our_kernels_are_packed_and_existing_entries_are_kept(tmp_path):
    made = tmp_path / "made"
    packed = _fake_triton_cache(made, {"_decode_split_kernel": "ours", "some_inductor_kernel": "theirs"})
    assert compile_cache.pack_triton_kernels(made, {"_decode_split_kernel"}) != packed
    packed = compile_cache.pack_triton_kernels(made, {"_decode_split_kernel"})
    local = tmp_path / "local"
    (local / "ours").mkdir(parents=True)
    (local / "ours" / "kept.txt").write_text("already here")
    assert compile_cache.unpack_triton_kernels(packed, local) == 0           # present: left alone
    assert [p.name for p in (local / "ours").iterdir()] == ["kept.txt"]
    fresh = tmp_path / "fresh"
    assert compile_cache.unpack_triton_kernels(packed, fresh) == 1
    assert (fresh / "ours" / "_decode_split_kernel.cubin").read_bytes() == b"\x7fELFours"
    assert not (fresh / "theirs").exists() and [p.name for p in fresh.iterdir()] == ["ours"]
    assert compile_cache.pack_triton_kernels(tmp_path / "missing", {"x"}) == b""


def test_a_packed_entry_cannot_escape_the_cache(tmp_path):
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        archive.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(tarfile.TarError):
        compile_cache.unpack_triton_kernels(buffer.getvalue(), tmp_path / "cache")
    assert not (tmp_path / "escaped.txt").exists()


def test_the_packed_kernels_are_flare_s_own():
    names = compile_cache.kernel_names()
    assert {"_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_write_kv_kernel"} <= names
    assert "_gemv_kernel" not in names                  # serving runs no gemv: nothing of it to carry


def test_the_warm_up_runs_a_request_through_the_engine_of_the_plan(stories260k, monkeypatch):
    """The preparation warm-up on the CPU: the same engine set-up and requests as on a GPU (a full
    prefill chunk, a shorter remainder, then decoding beside a second prompt: a mixed step; last a prompt
    of a few tokens, the multi-query attention path), where nothing is compiled or captured, so it keeps
    no artifacts."""
    seen = {"mixed_steps": 0, "few_token_steps": 0}
    real_warm_up = warm_up_module.warm_up

    def observed(core, vocab_size, prompt_tokens):
        def launch(plan, real_launch=core.runner.launch):
            lengths = [row.num_new_tokens for row in plan.rows]
            if 1 in lengths and max(lengths) > 1:
                seen["mixed_steps"] += 1
            if lengths == [warm_up_module.WARM_UP_FEW_TOKENS]:
                seen["few_token_steps"] += 1
            return real_launch(plan)

        core.runner.launch = launch
        real_warm_up(core, vocab_size, prompt_tokens)
        seen.update(prompt_tokens=prompt_tokens, stats=core.stats(check_integrity=True))

    monkeypatch.setattr(warm_up_module, "warm_up", observed)
    plan = _plan(dtype="float32", page_size=16, prefill_chunk=64, max_concurrency=4, decode_capacities=(1, 2, 4))
    prepared = prepare_gpu.prepare_compiled(stories260k, plan, device="cpu")
    assert prepared.artifacts is None and prepared.captured_sizes == ()
    assert seen["prompt_tokens"] == 64 + 32 + 1
    stats = seen["stats"]
    assert stats.num_computed_tokens == ((97 + 1) + (warm_up_module.WARM_UP_SHORT_PROMPT + 1)
                                         + (warm_up_module.WARM_UP_FEW_TOKENS + 1))
    assert seen["few_token_steps"] == 1
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert seen["mixed_steps"] == 1                     # the second prompt arrived while the first decoded
    assert stats.page_integrity == "ok"


def test_running_out_of_gpu_memory_while_preparing_is_the_capacity_error(export, cache_root, monkeypatch):
    """The warm-up allocates on the GPU; an out-of-memory error there is reported in the section-6 form
    (exit 4), and nothing is published."""
    from flare import memory
    from flare.errors import CapacityError

    class OutOfMemoryError(RuntimeError):          # torch.OutOfMemoryError's name and message
        pass

    def out_of_memory(checkpoint_dir, plan, device, compile_workers):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                               "of 79.19 GiB of which 1.50 GiB is free.")

    monkeypatch.setattr(prepare, "_device", lambda gpus: "cuda")
    monkeypatch.setattr(memory, "read_device_memory",
                        lambda: [memory.DeviceMemory(0, "test GPU", free=80 * 1024 ** 3, total=80 * 1024 ** 3)])
    monkeypatch.setattr(prepare_gpu, "prepare_compiled", out_of_memory)
    with pytest.raises(CapacityError) as refused:
        export()
    assert refused.value.exit_code == 4
    assert "ran out of GPU memory during preparation: Tried to allocate 2.00 GiB" in str(refused.value)
    assert "Options:" in str(refused.value)
    assert not (cache_root / "refs" / "stories260k").exists()


def test_no_compile_is_recorded_in_the_package_and_followed_when_serving(export, approved):
    from flare.engine.config import EngineConfig
    from flare.server.package_model import load_package_model

    entry = export(compile=False)
    assert open_package(entry, approved).plan.compile is False
    loaded = load_package_model(str(entry), EngineConfig(max_model_len=256, num_pages=64), "cpu", "float32")
    assert loaded.compile_layers is False
    assert open_package(export(), approved).plan.compile is True


def test_compile_workers_must_be_positive(export):
    from flare.errors import UsageError
    with pytest.raises(UsageError, match="--compile-workers must be a positive integer, not 0"):
        export(compile_workers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_export_carries_compiled_kernels_that_serving_loads(tmp_path, cache_root, approved):
    """On a GPU, for real: export compiles and captures a tiny Llama, the package carries torch.compile's
    artifacts and our Triton kernels under this machine's key, and loading them for serving takes them."""
    from tiny_checkpoints import write_tiny_checkpoint

    from flare.prepare import CheckpointSource, ExportOptions, RecipeFacts, export_model
    from flare.ui.progress import PhaseProgress

    checkpoint = write_tiny_checkpoint("llama", tmp_path / "llama")         # 16-wide heads: Triton attention
    recipe = RecipeFacts(name="llama", model_id="tiny-llama", page_size=16, prefill_chunk=64,
                         default_concurrency=4, max_concurrency=8)
    stream = io.StringIO()
    entry = export_model(CheckpointSource(checkpoint), recipe, ExportOptions(cache_root=cache_root),
                         PhaseProgress(stream=stream, styled=False))
    assert "decoder layers compiled and warmed up" in stream.getvalue()
    package = open_package(entry, approved)
    import torch

    from flare.engine.step_cost import decode_batch_rows

    costs = package.plan.step_costs                      # steps timed on this GPU, decodes and prompt work
    assert costs.device == torch.cuda.get_device_name()
    assert costs.decode_batches == decode_batch_rows(package.plan.max_concurrency)
    assert costs.prompt_tokens == (0, 64, 128) and all(ms > 0 for row in costs.milliseconds for ms in row)
    data, key, kernels, builds = package.compiled_artifacts()
    assert data and kernels and key == compile_cache.environment_key()
    assert bool(builds) == (package.plan.prefill_attention != "triton")   # FlashInfer's build travels when chosen
    note = compile_cache.load_artifacts(CompiledArtifacts(data, key, kernels, builds))
    assert note.startswith("compiled kernels from the package")


def test_inspect_graphs_says_what_compiled_code_the_package_carries(export, gpu_prepared, capsys):
    import json

    from flare.cli.flare import main

    entry = export()
    assert main(["inspect", str(entry), "--graphs", "--json"]) == 0
    [rank] = json.loads(capsys.readouterr().out)["graphs"]
    assert rank["compiled"] == {"torch_compile_bytes": len(gpu_prepared.data),
                                "triton_kernel_bytes": len(gpu_prepared.triton_kernels),
                                "flashinfer_build_bytes": len(gpu_prepared.flashinfer_kernels), "prepared_with": KEY}
    assert main(["inspect", str(entry), "--graphs"]) == 0
    text = capsys.readouterr().out
    assert "torch.compile" in text and "NVIDIA H200" in text and max(map(len, text.splitlines())) <= 80


def test_inspect_graphs_of_a_cpu_package(export, capsys):
    import json

    from flare.cli.flare import main

    assert main(["inspect", str(export()), "--graphs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["graphs"][0]["compiled"] is None


@pytest.mark.parametrize("passed", [True, False])
def test_the_plan_records_prompt_graphs_only_when_export_checked_them(export, approved, monkeypatch, passed):
    """Their buckets go into the signed plan and the catalog; serving's engine config takes the buckets
    its step budget reaches; inspect shows them, or that those steps run eagerly and why."""
    from flare.engine.prompt_graphs import PromptGraphCheck
    from flare.memory import KVPool
    from flare.package.inspect import InspectOptions, build_report, sections
    from flare.server.kv_sizing import serving_engine_config
    from flare.server.launch import _package_model

    note = ("replays match the eager step (worst relative error 1.2e-03)" if passed else
            "not captured: a replay differs from the eager step by 3.0e-01 (relative), over 2e-02")
    check = PromptGraphCheck((16, 32, 64, 128, 256, 512) if passed else (), note)
    artifacts = CompiledArtifacts(bytes(range(256)), KEY, b"")
    monkeypatch.setattr(prepare, "_prepare_code", lambda directory, plan, device, progress, workers=None:
                        PreparedCode(artifacts, (1, 2, 4), 1.5, None, 0.0, check))
    package = open_package(export(), approved)
    assert package.plan.prompt_graph_sizes == check.sizes
    [catalog] = package.graph_catalogs.values()
    assert (catalog.prompt_tokens, catalog.prompt_note) == (check.sizes, note)
    model = _package_model(package, weight_bytes=0)
    config = serving_engine_config(model, 1, KVPool(pages=64, page_size=model.page_size, limited_by="memory",
                                                    bytes=0))
    budget = config.max_num_batched_tokens
    assert config.prompt_graph_sizes == (tuple(s for s in check.sizes if s < budget)
                                         + tuple(s for s in check.sizes if s >= budget)[:1])
    [graphs] = [s for s in sections(build_report(package, InspectOptions(graphs=True))) if s.title.startswith("Graphs")]
    shown = dict(graphs.rows)["prompt steps"]
    assert shown == (f"piecewise graphs at 16, 32, 64, 128, 256, 512 tokens ({note})" if passed else f"eager ({note})")


def test_a_cpu_export_says_its_prompt_steps_run_eagerly(export, approved):
    from flare.package.inspect import InspectOptions, build_report, sections

    package = open_package(export(), approved)
    assert package.plan.prompt_graph_sizes == ()
    [graphs] = [s for s in sections(build_report(package, InspectOptions(graphs=True))) if s.title.startswith("Graphs")]
    assert dict(graphs.rows)["prompt steps"] == "eager (prepared without a GPU)"


def test_fp8_plans_capture_prompt_graphs_up_to_the_step_budget(tmp_path):
    """Export checks the larger FP8 set of prompt buckets when the plan (online FP8) or the checkpoint puts
    projections in FP8; otherwise the steps past 512 tokens stay eager."""
    from flare.engine.config import FP8_PROMPT_GRAPH_BUCKETS, PROMPT_GRAPH_BUCKETS
    from flare.models.quantization import DECODER_PROJECTIONS
    from tiny_checkpoints import write_tiny_checkpoint

    directory = write_tiny_checkpoint("llama", tmp_path)
    plan = Plan(dtype="bfloat16", page_size=16, prefill_chunk=2048, compile=True, max_concurrency=256,
                decode_capacities=(1, 256), max_model_len=4096, memory_reserve_bytes=0, tensor_parallel=1)
    assert prepare_gpu.plan_prompt_graph_sizes(directory, plan) == PROMPT_GRAPH_BUCKETS
    fp8_plan = msgspec.structs.replace(plan, online_fp8=DECODER_PROJECTIONS)
    assert prepare_gpu.plan_prompt_graph_sizes(directory, fp8_plan) == FP8_PROMPT_GRAPH_BUCKETS
    smaller = msgspec.structs.replace(fp8_plan, prefill_chunk=512, max_concurrency=16)      # budget 1,040
    assert prepare_gpu.plan_prompt_graph_sizes(directory, smaller)[-2:] == (1024, 1536)
