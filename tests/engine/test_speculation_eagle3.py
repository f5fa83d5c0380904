"""Drafting with an EAGLE-3 head over stories260k's hidden states (a tiny head in the public layout, random
weights: this tests the wiring, never acceptance). Greedy output is the output without drafts, and the
head's first draft of a round is what the head computes over the whole sequence: the tokens after each
position beside the target's features of that position."""

from __future__ import annotations

import shutil

import pytest
import torch
from eagle3_checkpoints import write_tiny_eagle3

from flare.engine.attention import AttentionMetadata, allocate_kv_caches
from flare.engine.config import EngineConfig
from flare.engine.sampling_params import SamplingParams
from flare.engine.speculation.settings import SpeculationSettings
from flare.engine_client.llm_engine import LLMEngine

PROMPTS = ["Once upon a time", "Tom had a red ball. Tom had a red ball. Tom had a", "The sun was hot."]
EAGLE = SpeculationSettings(draft_tokens=3, draft_model=True, adaptive=False)


@pytest.fixture(scope="module")
def with_head(stories260k, tmp_path_factory):
    directory = tmp_path_factory.mktemp("eagle") / "stories260k"
    directory.mkdir()
    for item in stories260k.iterdir():
        if item.is_file():
            shutil.copy2(item, directory / item.name)
    write_tiny_eagle3(directory / "draft", target_hidden=64, vocab=512, draft_vocab=256, aux_layers=[1, 2, 3])
    return directory


def generate(directory, speculation, checked, **settings):
    config = EngineConfig(**{"page_size": 16, "num_pages": 64, "max_model_len": 512, "speculation": speculation,
                             **settings})
    llm = checked(LLMEngine.from_checkpoint(directory, config, seed=0))
    return llm, [list(o.new_token_ids) for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))]


def test_greedy_output_with_an_eagle3_head_is_the_output_without(with_head, stories260k, checked):
    _, plain = generate(stories260k, SpeculationSettings(), checked)
    llm, drafted = generate(with_head, EAGLE, checked)
    assert drafted == plain
    stats = llm.core.stats()
    assert stats.speculative_rounds > 0 and stats.draft_tokens_proposed_by_position[0] == stats.speculative_rounds
    _, chunked = generate(with_head, EAGLE, checked, prefill_chunk=4, max_num_batched_tokens=16)
    assert chunked == plain


def test_the_first_draft_is_the_heads_reading_of_the_whole_sequence(with_head, checked):
    config = EngineConfig(page_size=16, num_pages=64, max_model_len=512, speculation=EAGLE)
    llm = checked(LLMEngine.from_checkpoint(with_head, config, seed=0))
    runner = llm.core.runner
    proposer = runner.proposer
    recorded = []
    run = proposer.run

    def recording(plan, slots, sampler):
        proposal = run(plan, slots, sampler)
        if proposal is not None:
            for r, i in enumerate(proposal.rows):
                recorded.append((plan.rows[i].num_computed_tokens, int(proposal.tokens[r, 0])))
        return proposal

    proposer.run = recording
    [output] = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24))
    ids = llm.tokenizer.encode(PROMPTS[1]) + list(output.new_token_ids)
    target, head = runner.model, proposer.head
    length = len(ids)
    pages = [list(range(-(-length // 16)))]
    meta = AttentionMetadata.build([length], [length], pages, 16)
    with torch.inference_mode():
        target(torch.tensor(ids), torch.arange(length), allocate_kv_caches(target.cfg, 40, 16, torch.float32, "cpu"),
               meta)
        features = head.combine(target.model.aux_hidden)
        # Row p reads the token at p + 1 beside the target's feature at p.
        rows = length - 1
        head_meta = AttentionMetadata.build([rows], [rows], pages, 16)
        normed, _ = head(torch.tensor(ids[1:]), torch.arange(rows), features[:rows],
                         allocate_kv_caches(head.cfg.layer, 40, 16, torch.float32, "cpu")[:1], head_meta)
        expected = head.compute_logits(normed).argmax(dim=-1)
    assert recorded, "the head proposed no drafts"
    for position, first_draft in recorded:
        # A round fed the token at `position`; its first draft is the head's choice at row position - 1.
        assert first_draft == int(expected[position - 1]), f"round at {position}"
