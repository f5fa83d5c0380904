"""The real trained stories260k model reproduces the recorded transformers logits and greedy story."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flare.engine.attention import TorchReferenceBackend
from flare.models import load_checkpoint
from models.paged_runner import PagedRunner


@pytest.fixture(scope="module")
def loaded(stories260k):
    cfg, model = load_checkpoint(stories260k, torch.float32, "cpu", TorchReferenceBackend())
    return cfg, model, json.loads((stories260k / "reference" / "greedy.json").read_text())


def test_teacher_forced_logits_equal_the_recorded_ones(loaded, stories260k):
    cfg, model, reference = loaded
    expected = torch.from_numpy(np.load(stories260k / "reference" / "teacher_forced_logits.npy"))
    logits = PagedRunner(cfg, model).step({"story": reference["prompt_ids"] + reference["greedy_ids"]})["story"]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_greedy_continuation_of_once_upon_a_time_equals_the_recorded_one(loaded):
    cfg, model, reference = loaded
    generated = PagedRunner(cfg, model).greedy("story", reference["prompt_ids"], reference["max_new_tokens"])
    assert generated == reference["greedy_ids"]


def test_tied_checkpoint_without_lm_head_reads_its_embeddings(loaded):
    cfg, model, _ = loaded
    assert cfg.tie_word_embeddings
    assert model.lm_head.matrix is model.model.embed_tokens.weight
