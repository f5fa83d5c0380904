"""One list of decode graph batch sizes: what `ignition export ALIAS --help` and `flare inspect --graphs`
report is what the plan records and what serving captures (spec section 4, "Decode graph capacities")."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from flare.cli.flare import main as flare_main
from flare.cli.ignition import main as ignition_main
from flare.engine.config import EngineConfig
from flare.engine.factory import load_checkpoint_model
from flare.engine.runner import ModelRunner
from flare.errors import UsageError
from flare.memory import KVPool
from flare.recipes import registry
from flare.recipes.base import DECODE_CAPACITIES, decode_capacities_for
from flare.server.kv_sizing import serving_engine_config
from flare.server.launch import _package_model
from flare.package.reader import open_package
from flare.package.trust import TrustOptions


def _stdout(main, *argv) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def _export(stories260k, concurrency: int) -> Path:
    code, out = _stdout(ignition_main, "export", str(stories260k), "--max-concurrency", str(concurrency))
    assert code == 0
    return Path(out.strip().splitlines()[-1])


def _help_sizes(alias: str) -> list[int]:
    code, out = _stdout(ignition_main, "export", alias, "--help")
    assert code == 0
    line = next(line for line in out.splitlines() if "decode capacities" in line)
    return [int(size) for size in re.search(r"decode capacities\s+([\d,]+)", line)[1].split(",")]


def _captured_by_serving(entry: Path, stories260k, concurrency: int | None = None) -> tuple[int, ...]:
    """The sizes the serving runner builds graphs for: the package served as `flare run` builds its
    engine configuration, then the runner's static-buffer graphs (captured on a GPU, eager here)."""
    trust = TrustOptions(approve_key=_fingerprint(), accept_publisher="local-development", offline=True)
    with open_package(entry, trust) as package:
        model = _package_model(package, weight_bytes=0)
    concurrency = concurrency or model.prepared_concurrency
    pool = KVPool(pages=64, page_size=model.page_size, limited_by="memory", bytes=0)
    config = serving_engine_config(model, concurrency, pool)
    loaded = load_checkpoint_model(stories260k, EngineConfig(max_concurrency=1, max_model_len=64, num_pages=8))
    runner = ModelRunner(loaded.model, loaded.model_config, config, "cpu", torch.float32, graphs=True, capture=False)
    return runner.graphs.sizes


def test_at_the_largest_concurrency_help_plan_inspect_and_serving_agree(stories260k):
    recipe = registry.recipe_for_architecture("LlamaForCausalLM")
    alias = recipe.checkpoints[0].alias
    maximum = recipe.concurrency.maximum
    entry = _export(stories260k, maximum)
    code, out = _stdout(flare_main, "inspect", str(entry), "--graphs", "--json")
    assert code == 0
    report = json.loads(out)
    planned = report["capacities"]["decode_capacities"]
    assert [graphs["catalog"]["captured"] for graphs in report["graphs"]] == [planned]
    assert _help_sizes(alias) == planned
    assert list(_captured_by_serving(entry, stories260k)) == planned
    assert planned[-1] == maximum and len(planned) == len(DECODE_CAPACITIES)


def test_a_reduced_serving_concurrency_captures_the_plans_sizes_that_hold_it(stories260k):
    entry = _export(stories260k, 64)
    assert _captured_by_serving(entry, stories260k, concurrency=3) == (1, 2, 4)    # three takes the four bucket
    assert _captured_by_serving(entry, stories260k, concurrency=20) == (1, 2, 4, 8, 16, 24)


def test_the_engine_configuration_carries_the_sizes_it_captures():
    assert EngineConfig(max_concurrency=20).decode_graph_sizes == (1, 2, 4, 8, 16, 24)
    assert EngineConfig(max_concurrency=3, decode_graph_catalog=(1, 2, 4)).decode_graph_sizes == (1, 2, 4)
    with pytest.raises(UsageError, match="fewer than max_concurrency 8"):
        EngineConfig(max_concurrency=8, decode_graph_catalog=(1, 2, 4))
    with pytest.raises(UsageError, match="rising order"):
        EngineConfig(max_concurrency=4, decode_graph_catalog=(4, 2, 1))


def test_the_rule_rounds_up_to_the_captured_set():
    assert decode_capacities_for(DECODE_CAPACITIES, 1) == (1,)
    assert decode_capacities_for(DECODE_CAPACITIES, 3) == (1, 2, 4)
    assert decode_capacities_for(DECODE_CAPACITIES, 65) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80)
    with pytest.raises(ValueError):
        decode_capacities_for(DECODE_CAPACITIES, 0)
    with pytest.raises(ValueError, match="no captured batch size holds 300"):
        decode_capacities_for(DECODE_CAPACITIES, 300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_on_a_gpu_captures_exactly_the_reported_sizes(tmp_path):
    """Exported and loaded on a GPU as `flare run` loads it: the captured graphs are the reported ones."""
    from flare.engine.factory import build_core
    from flare.server.package_model import load_package_model
    from tiny_checkpoints import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint("llama", tmp_path / "llama")          # heads wide enough for Triton
    code, out = _stdout(ignition_main, "export", str(checkpoint), "--max-concurrency", "20", "--no-compile")
    assert code == 0
    entry = Path(out.strip().splitlines()[-1])
    code, out = _stdout(flare_main, "inspect", str(entry), "--graphs", "--json")
    reported = json.loads(out)["graphs"][0]["catalog"]["captured"]
    with open_package(entry, TrustOptions(approve_key=_fingerprint(), accept_publisher="local-development",
                                          offline=True)) as package:
        model = _package_model(package, weight_bytes=0)
    pool = KVPool(pages=64, page_size=model.page_size, limited_by="memory", bytes=0)
    config = serving_engine_config(model, model.prepared_concurrency, pool)
    core = build_core(load_package_model(str(entry), config, "cuda", model.dtype))
    assert sorted(core.runner.graphs.graphs) == reported == [1, 2, 4, 8, 16, 24]


def _fingerprint() -> str:
    from flare.package.signing import config_dir_for, development_identity

    return development_identity(config_dir_for(None)).public_key.fingerprint
