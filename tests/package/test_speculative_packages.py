"""Speculation in packages: an export records its speculative catalog (B/D/W/P) in the plan, and
`flare inspect` shows it; --no-mtp records none."""

from __future__ import annotations

import json

from flare.cli.flare import main as flare_main
from flare.speculation_plan import PreparationFlags as Flags


def test_an_export_records_the_plan_and_inspect_shows_the_catalog(export, capsys):
    entry = export(max_concurrency=4, speculation=Flags(draft_tokens=3, token_capacity=8))
    assert flare_main(["inspect", str(entry), "--json", "--graphs"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speculation"] == {"draft_tokens": 3, "adaptive": True, "token_capacity": 8,
                                     "history_drafts": True, "draft_model": None}
    programs = report["graphs"][0]["speculative_programs"]["programs"]
    assert [(p["batch"], p["drafts"], p["width"], p["rows"]) for p in programs] == [
        (1, 1, 2, 2), (1, 2, 3, 3), (1, 3, 4, 4), (2, 1, 2, 4), (2, 2, 3, 6), (2, 3, 4, 8), (4, 1, 2, 8)]
    assert flare_main(["inspect", str(entry), "--graphs"]) == 0
    assert "B/D/W/P 1/1/2/2" in capsys.readouterr().out
    assert export(speculation=Flags(no_mtp=True)) is not None
    assert flare_main(["inspect", str(export(speculation=Flags(no_mtp=True))), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speculation"] is None


def test_a_learned_draft_travels_as_payloads_of_the_package_and_serves(stories260k, cache_root, tmp_path):
    """A checkpoint that supplies a draft in draft/: its weights become weights/draft/ payloads, the plan
    records its config, and the package's engine drafts with it, greedy output unchanged."""
    import io

    from draft_checkpoints import STORIES_DRAFT, with_draft

    from flare.engine.config import EngineConfig
    from flare.engine.factory import build_core
    from flare.engine.sampling_params import SamplingParams
    from flare.engine.speculation.settings import SpeculationSettings
    from flare.engine_client.llm_engine import LLMEngine
    from flare.frontend.tokenizer import load_tokenizer
    from flare.package.reader import open_unverified
    from flare.prepare import CheckpointSource, ExportOptions, export_model
    from flare.server.package_model import load_package_model
    from flare.ui.progress import PhaseProgress
    from tests.package.conftest import STORIES_RECIPE

    directory = with_draft(stories260k, STORIES_DRAFT, tmp_path / "stories260k")
    log = io.StringIO()
    entry = export_model(CheckpointSource(directory, draft_dir=directory / "draft"), STORIES_RECIPE,
                         ExportOptions(cache_root=cache_root, dtype="float32", max_concurrency=4),
                         PhaseProgress(stream=log, styled=False))
    assert "Load draft weights" in log.getvalue()
    package = open_unverified(entry)
    draft = package.plan.speculation.draft
    assert draft.kind == "model" and draft.config["num_hidden_layers"] == 2 and draft.repo_id is None
    names = [record.name for record in package.weight_payloads()]
    assert any(name.startswith("weights/draft/") for name in names)
    assert {name for name, _ in package.iter_weights(draft=True)} == {
        "model.embed_tokens.weight", "model.norm.weight", *(f"model.layers.{i}.{part}" for i in range(2) for part in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight"))}
    target = [name for name, _ in package.iter_weights()]
    assert len(target) == len(set(target)) and "model.layers.4.mlp.up_proj.weight" in target    # no draft tensor
    settings = SpeculationSettings(draft_tokens=3, draft_model=True)
    config = EngineConfig(page_size=16, num_pages=64, max_model_len=512, speculation=settings)
    loaded = load_package_model(str(entry), config, "cpu", "float32")
    assert loaded.draft is not None
    llm = LLMEngine(build_core(loaded), load_tokenizer(stories260k))
    params = SamplingParams(temperature=0, max_tokens=40)
    [drafted] = llm.generate(["Once upon a time"], params)
    assert llm.core.stats().draft_tokens_accepted > 0
    [plain] = LLMEngine.from_checkpoint(stories260k).generate(["Once upon a time"], params)
    assert drafted.new_token_ids == plain.new_token_ids


def test_ignition_export_takes_the_draft_a_checkpoint_supplies_unless_no_mtp(stories260k, tmp_path, capsys):
    from draft_checkpoints import STORIES_DRAFT, with_draft

    from flare.cli.ignition import main as ignition_main

    directory = with_draft(stories260k, STORIES_DRAFT, tmp_path / "stories260k")
    assert ignition_main(["export", str(directory), "--max-concurrency", "2", "--mtp-draft-tokens", "3"]) == 0
    entry = capsys.readouterr().out.strip().splitlines()[-1]
    assert flare_main(["inspect", entry, "--json"]) == 0
    speculation = json.loads(capsys.readouterr().out)["speculation"]
    assert speculation["draft_tokens"] == 3 and speculation["draft_model"]["layers"] == 2
    assert ignition_main(["export", str(directory), "--max-concurrency", "2", "--no-mtp"]) == 0
    entry = capsys.readouterr().out.strip().splitlines()[-1]
    assert flare_main(["inspect", entry, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speculation"] is None
