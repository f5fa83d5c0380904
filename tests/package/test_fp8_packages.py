"""FP8 checkpoints through export and serving: the package keeps the e4m3 bytes and float32 scales, and the
engine serving it gives the greedy tokens of the checkpoint's dequantized weights."""

from __future__ import annotations

import io

import pytest

from flare.engine.config import EngineConfig
from flare.engine.factory import build_core
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams
from flare.frontend.tokenizer import load_tokenizer
from flare.package import safetensors_io as st
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
