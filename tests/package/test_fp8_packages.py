"""FP8 checkpoints through export and serving: the package keeps the e4m3 bytes and float32 scales, and the
engine serving it gives the greedy tokens of the checkpoint's dequantized weights."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from flare.engine.attention import TorchReferenceBackend
from flare.engine.config import EngineConfig
from flare.engine.factory import build_core
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams
from flare.errors import UsageError
from flare.frontend.tokenizer import load_tokenizer
from flare.models import load_checkpoint
from flare.models.quantization import DECODER_PROJECTIONS
from flare.package import safetensors_io as st
from flare.package.inspect import InspectOptions, build_report
from flare.package.reader import open_package
from flare.prepare import CheckpointSource, ExportOptions, export_model
from flare.server.package_model import load_package_model
from flare.ui.progress import PhaseProgress
from fp8_checkpoints import write_block_fp8, write_compressed_tensors_fp8, write_dequantized
from package.conftest import STORIES_RECIPE

PROMPTS = ["Once upon a time", "The little dog"]
CONFIG = EngineConfig(page_size=16, num_pages=64, max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def export_checkpoint(directory, cache_root):
    return export_model(CheckpointSource(directory), STORIES_RECIPE,
                        ExportOptions(cache_root=cache_root, dtype="float32"),
                        PhaseProgress(stream=io.StringIO(), styled=False))


def greedy_texts(engine: LLMEngine) -> list[list[int]]:
    return [list(output.new_token_ids) for output in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("layout", ["block", "compressed-tensors"])
def test_an_fp8_checkpoint_serves_the_tokens_of_its_dequantized_weights(stories260k, tmp_path, cache_root,
                                                                        approved, layout):
    if layout == "block":
        fp8 = write_block_fp8(stories260k, tmp_path / "fp8")
        scale = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    else:
        fp8 = write_compressed_tensors_fp8(stories260k, tmp_path / "fp8", "tensor")
        scale = "model.layers.0.mlp.gate_proj.weight_scale"
    entry = export_checkpoint(fp8, cache_root)

    with open_package(entry, approved) as package:
        record = next(r for r in package.weight_payloads() if r.name == "weights/layer-000.safetensors")
        location = package.files.locate(record)
        with open(location.path, "rb") as handle:
            stored = {e.name: e.dtype for e in st.read_header(handle, location.offset, record.size, what="").tensors}
    assert stored["model.layers.0.mlp.gate_proj.weight"] == "F8_E4M3"
    assert stored[scale] == "F32"                                   # BF16 in the checkpoint, float32 kept

    loaded = load_package_model(str(entry), CONFIG, "cpu", "float32")
    served = LLMEngine(build_core(loaded), load_tokenizer(fp8))
    reference = LLMEngine.from_checkpoint(write_dequantized(fp8, tmp_path / "reference"), CONFIG)
    assert greedy_texts(served) == greedy_texts(reference)


ONLINE_RECIPE = replace(STORIES_RECIPE, online_fp8_projections=DECODER_PROJECTIONS)


def export_stories(stories260k, cache_root, recipe=ONLINE_RECIPE, stream=None, **options):
    return export_model(CheckpointSource(stories260k), recipe,
                        ExportOptions(cache_root=cache_root, dtype="float32", **options),
                        PhaseProgress(stream=stream or io.StringIO(), styled=False))


def estimate_of(checkpoint, plan):
    """The capacity estimate export checks before any weight loads (the section-6 error's figures)."""
    from flare import prepare

    hf_config = json.loads((checkpoint / "config.json").read_text())
    return prepare._fit_memory(checkpoint, hf_config, plan, prepare.RecipeFacts(name="llama", model_id="x"), None,
                               "cpu").estimate


def test_online_fp8_export_stores_the_projections_as_e4m3_blocks_and_serves_them(stories260k, cache_root, approved):
    log = io.StringIO()
    entry = export_stories(stories260k, cache_root, stream=log, online_fp8=True)
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj as FP8 e4m3" in log.getvalue()
    with open_package(entry, approved) as package:
        assert package.plan.online_fp8 == DECODER_PROJECTIONS and package.plan.kv_cache_dtype == "auto"
        stored_records = [t for r in package.weight_payloads() for t in r.tensors]
        stored = {t.name: (t.dtype, t.shape) for t in stored_records}
        report = build_report(package, InspectOptions(memory_map=True))
    assert stored["model.layers.0.mlp.up_proj.weight"] == ("F8_E4M3", (172, 64))
    assert stored["model.layers.0.mlp.up_proj.weight_scale_inv"] == ("F32", (2, 1))      # partial 128x128 blocks
    assert stored["model.embed_tokens.weight"][0] == "F32"
    assert "online from BF16 at export" in report["capacities"]["weights"]
    layer = next(p for p in report["memory_map"][0]["payloads"] if p["name"] == "weights/layer-000.safetensors")
    assert set(layer["storage"]) == {"F8_E4M3", "F32"} and layer["storage"]["F8_E4M3"] > layer["storage"]["F32"]
    dense_bytes = sum(r.size for r in open_package(export_stories(stories260k, cache_root / "dense"),
                                                   approved).weight_payloads())
    assert report["ranks"][0]["weight_bytes"] < dense_bytes
    assert estimate_of(stories260k, package.plan).weights_bytes == sum(      # the section-6 estimate's weights
        t.data_offsets[1] - t.data_offsets[0] for t in stored_records)

    served = LLMEngine(build_core(load_package_model(str(entry), CONFIG, "cpu", "float32")), load_tokenizer(stories260k))
    cfg, model = load_checkpoint(stories260k, torch.float32, "cpu", TorchReferenceBackend(),
                                 online_fp8=DECODER_PROJECTIONS)
    converted_at_load = LLMEngine.from_model(model, cfg, load_tokenizer(stories260k), CONFIG)
    assert greedy_texts(served) == greedy_texts(converted_at_load)


def test_online_fp8_is_refused_by_a_recipe_without_eligible_projections(stories260k, cache_root):
    with pytest.raises(UsageError, match="--online-mxfp8: the llama recipe names no projections"):
        export_stories(stories260k, cache_root, recipe=STORIES_RECIPE, online_fp8=True)


def test_online_fp8_of_an_fp8_checkpoint_is_refused(stories260k, tmp_path, cache_root):
    fp8 = write_block_fp8(stories260k, tmp_path / "fp8")
    with pytest.raises(UsageError, match="already FP8"):
        export_model(CheckpointSource(fp8), ONLINE_RECIPE, ExportOptions(cache_root=cache_root, online_fp8=True),
                     PhaseProgress(stream=io.StringIO(), styled=False))


def test_an_fp8_kv_cache_is_recorded_in_the_plan_and_allocated_when_serving(stories260k, cache_root, approved):
    entry = export_stories(stories260k, cache_root, kv_cache_dtype="fp8")
    with open_package(entry, approved) as package:
        assert package.plan.kv_cache_dtype == "fp8"
        report = build_report(package, InspectOptions())
    per_head = 8 + 4                                              # stories260k: head_dim 8, one float32 scale
    assert report["capacities"]["kv_bytes_per_token"] == 2 * 5 * 4 * per_head
    loaded = load_package_model(str(entry), CONFIG, "cpu", "float32")
    assert loaded.model_config.kv_cache_dtype == "fp8"
    engine = LLMEngine(build_core(loaded), load_tokenizer(stories260k))
    assert all(len(tokens) == GREEDY.max_tokens for tokens in greedy_texts(engine))


def test_export_help_says_what_online_mxfp8_stores():
    code = "import sys; from flare.cli.ignition import main; sys.exit(main(sys.argv[1:]))"
    general = subprocess.run([sys.executable, "-c", code, "export", "--help"], capture_output=True, text=True)
    assert general.returncode == 0, general.stderr
    text = " ".join(general.stdout.split())
    assert ("--online-mxfp8 store the recipe's eligible BF16 projections (the decoder's q/k/v/o and gate/up/down) "
            "as FP8 e4m3 with one float32 scale per 128x128 block") in text
    assert "Hopper has no MXFP8 (1x32 blocks, E8M0 scales) instructions" in text
    card = subprocess.run([sys.executable, "-c", code, "export", "llama-3.1-8b-instruct", "--help"],
                          capture_output=True, text=True).stdout
    # 32 layers of 218M e4m3 bytes (and their scales), plus the bfloat16 output projection: 1.05 GB
    assert "as FP8 e4m3, a float32 scale per 128x128 block; decode then reads 7.48 GiB" in card
    assert "128 KiB per cached token (bfloat16, one GPU); 66 KiB with --kv-cache-dtype fp8" in card
    fp8_card = subprocess.run([sys.executable, "-c", code, "export", "qwen3-8b-fp8", "--help"],
                              capture_output=True, text=True).stdout
    assert "online FP8         unavailable: the checkpoint is already FP8" in fp8_card
