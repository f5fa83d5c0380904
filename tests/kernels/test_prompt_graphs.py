"""Prompt-carrying and mixed steps through the piecewise graphs of flare.engine.prompt_graphs: the engine's
greedy tokens stay those of the plain eager step, steps past the largest bucket still run eagerly, and
export's check captures every bucket and finds its replays equal to the eager step (GPU), or refuses.

On a CPU the graphs run their padded forward eagerly on the same static buffers (capture=False); on a
GPU the same tests capture and replay real graphs."""

from __future__ import annotations

import pytest
import torch

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.errors import UsageError
from test_engine_mixed_steps import staggered_tokens
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_buckets_run_from_small_ones_to_the_first_that_holds_the_step_budget():
    from flare.engine.config import prompt_graph_sizes, prompt_sizes_for

    assert prompt_graph_sizes(100) == (16, 32, 64, 128)
    assert prompt_graph_sizes(4352) == (16, 32, 64, 128, 256, 384, 512)      # larger steps run eagerly
    assert prompt_graph_sizes(257) == (16, 32, 64, 128, 256, 384)
    assert prompt_graph_sizes(8) == (16,)
    # FP8 projections: host-bound eager steps well past 512 tokens, so buckets up to the default budget
    assert prompt_graph_sizes(4352, fp8_projections=True)[-8:] == (512, 768, 1024, 1536, 2048, 2304, 3072, 4352)
    assert prompt_graph_sizes(2100, fp8_projections=True)[-3:] == (1536, 2048, 2304)
    assert prompt_graph_sizes(100, fp8_projections=True) == prompt_graph_sizes(100)
    assert prompt_sizes_for((16, 32, 64, 256, 512), 40) == (16, 32, 64)     # serving below the prepared budget
    assert prompt_sizes_for((), 40) == ()


def test_the_engine_config_refuses_unordered_prompt_graph_sizes():
    assert EngineConfig(prompt_graph_sizes=(16, 64)).prompt_graph_sizes == (16, 64)
    with pytest.raises(UsageError, match=r"prompt_graph_sizes \[64, 16\] must be a tuple of distinct positive"):
        EngineConfig(prompt_graph_sizes=(64, 16))
    with pytest.raises(UsageError, match=r"prompt_graph_sizes \[16, 64\] must be a tuple"):
        EngineConfig(prompt_graph_sizes=[16, 64])


def test_a_model_on_the_reference_backend_cannot_be_captured(tiny_llama):
    from flare.engine.attention import TorchReferenceBackend
    from flare.engine.prompt_graphs import PromptGraphs, check_prompt_graphs
    from flare.models import load_checkpoint

    cfg, model = load_checkpoint(tiny_llama, torch.float32, "cpu", TorchReferenceBackend())
    caches = [torch.zeros(2, 4, 16, 2, 16)] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="attention does not run the Triton backend"):
        PromptGraphs(model, caches, (16,), capture=False)
    check = check_prompt_graphs(model, caches, (16,), range(4), 16, cfg.vocab_size)
    assert check.sizes == () and check.note == "not captured: attention does not run the Triton backend"


def run_engine(directory, device, prompt_graph_sizes, seen=None, drafter=None, draft=None):
    """Two requests, then a 40-token prompt prefilled in chunks of 16 beside their decodes; greedy tokens
    per request. `seen` collects the token count of every step the prompt graphs ran; with `drafter`,
    decoding requests carry its drafts (up to 3); with `draft` ((model, config)), a draft model's."""
    from flare.engine.factory import attention_backend_for
    from flare.engine.runner import ModelRunner
    from flare.engine.speculation.settings import SpeculationSettings
    from flare.models import load_checkpoint
    from flare.models.loader import read_model_config

    config = EngineConfig(max_concurrency=4, page_size=16, num_pages=32, max_model_len=128, prefill_chunk=16,
                          max_num_batched_tokens=32, enable_prefix_caching=False, decode_graph_catalog=(1, 2, 4),
                          prompt_graph_sizes=prompt_graph_sizes,
                          speculation=SpeculationSettings(draft_tokens=3 if drafter or draft else 0,
                                                          adaptive=False))
    backend = attention_backend_for(read_model_config(directory), "cuda")        # the Triton backend, any device
    cfg, model = load_checkpoint(directory, torch.float32, device, backend)
    runner = ModelRunner(model, cfg, config, device, torch.float32, seed=0, graphs=bool(prompt_graph_sizes),
                         draft=draft)
    if runner.prompt_graphs is not None and seen is not None:
        real_run = runner.prompt_graphs.run

        def observed(input_ids, positions, meta):
            seen.append(input_ids.shape[0])
            return real_run(input_ids, positions, meta)

        runner.prompt_graphs.run = observed
    return staggered_tokens(EngineCore(config, runner, drafter=drafter), cfg.vocab_size)


@pytest.mark.parametrize("sizes", [(16, 32), (16,)])
def test_prompt_and_mixed_steps_through_the_prompt_graphs_keep_the_eager_tokens(kernel_device, tiny_llama, sizes):
    expected = run_engine(tiny_llama, kernel_device, ())
    seen: list[int] = []
    assert run_engine(tiny_llama, kernel_device, sizes, seen) == expected
    assert sorted(expected) == ["a", "b", "long"]
    assert 14 in seen and max(seen) <= sizes[-1]                 # the first step: both prompts, 14 tokens
    if sizes == (16, 32):
        assert any(count > 16 for count in seen)                     # decodes beside a 16-token chunk
    # with (16,) alone, those steps ran eagerly beside the replays, and the tokens still agree


def test_latent_attention_steps_through_the_prompt_graphs_keep_the_eager_tokens(kernel_device, tmp_path):
    """DeepSeek's attention calls stage latent queries and cache rows (not per-head K/V) between the stretches."""
    directory = write_tiny_checkpoint("deepseek_v2", tmp_path)
    expected = run_engine(directory, kernel_device, ())
    seen: list[int] = []
    assert run_engine(directory, kernel_device, (16, 32), seen) == expected
    assert any(count > 16 for count in seen)


class ConstantDrafter:
    """Proposes the same tokens for every request: mostly wrong, so verification rejects most of them."""

    def propose(self, request, max_tokens: int) -> tuple[int, ...]:
        return (3, 4, 5)[:max_tokens]


def test_steps_carrying_drafts_run_through_the_prompt_graphs_and_keep_the_tokens(kernel_device, tiny_llama):
    expected = run_engine(tiny_llama, kernel_device, ())
    plain: list[int] = []
    run_engine(tiny_llama, kernel_device, (16, 32), plain)
    drafted: list[int] = []
    assert run_engine(tiny_llama, kernel_device, (16, 32), drafted, drafter=ConstantDrafter()) == expected
    # Decode steps leave the decode graphs when they carry drafts: the prompt graphs replay those too.
    assert len(drafted) > len(plain)


def test_a_draft_models_rounds_replay_the_target_through_the_prompt_graphs(kernel_device, tiny_llama):
    """A draft model runs beside every step, so the decode graphs stay off; the target's forward of its
    rounds ((1 + k) tokens a row) replays through the prompt graphs, and greedy tokens stay the eager ones."""
    from flare.engine.attention import TorchReferenceBackend
    from flare.models import load_checkpoint

    expected = run_engine(tiny_llama, kernel_device, ())
    plain: list[int] = []
    run_engine(tiny_llama, kernel_device, (16, 32), plain)
    draft_cfg, draft_model = load_checkpoint(tiny_llama, torch.float32, kernel_device, TorchReferenceBackend())
    drafted: list[int] = []
    assert run_engine(tiny_llama, kernel_device, (16, 32), drafted, draft=(draft_model, draft_cfg)) == expected
    # Without the draft, decode steps replay the decode graphs; beside it they replay the prompt graphs.
    assert len(drafted) > len(plain)


@pytest.mark.parametrize("reads_hidden_states", [False, True])
def test_which_graphs_a_learned_draft_leaves(tiny_llama, monkeypatch, reads_hidden_states):
    """Beside a learned draft no step fits the decode graphs; the prompt graphs stay, except beside an
    EAGLE-3 head, which reads the target's hidden states from Python (a replay would leave them stale)."""
    from types import SimpleNamespace

    from flare.engine.attention_triton import TritonBackend
    from flare.engine.runner import ModelRunner
    from flare.engine.speculation.settings import SpeculationSettings
    from flare.models import load_checkpoint

    monkeypatch.setattr(ModelRunner, "_proposer", lambda self, draft, dtype: SimpleNamespace(
        reads_target_hidden_states=reads_hidden_states))
    config = EngineConfig(max_concurrency=2, page_size=16, num_pages=8, max_model_len=64, prefill_chunk=16,
                          max_num_batched_tokens=32, decode_graph_catalog=(1, 2), prompt_graph_sizes=(16,),
                          speculation=SpeculationSettings(draft_tokens=2))
    cfg, model = load_checkpoint(tiny_llama, torch.float32, "cpu", TritonBackend())
    runner = ModelRunner(model, cfg, config, "cpu", torch.float32, seed=0, graphs=True, capture=False,
                         draft=("a learned draft", None))
    assert runner.graphs is None
    assert (runner.prompt_graphs is None) == reads_hidden_states


def test_the_export_check_needs_a_gpu(tiny_llama):
    from flare.engine.attention_triton import TritonBackend
    from flare.engine.prompt_graphs import check_prompt_graphs
    from flare.models import load_checkpoint

    cfg, model = load_checkpoint(tiny_llama, torch.float32, "cpu", TritonBackend())
    caches = [torch.zeros(2, 8, 16, 2, 16)] * cfg.num_hidden_layers
    check = check_prompt_graphs(model, caches, (16,), range(8), 16, cfg.vocab_size)
    assert (check.sizes, check.note, check.graphs) == ((), "not captured: CUDA graphs need a GPU", None)


def test_the_check_tells_a_faithful_replay_from_padding_that_leaks_into_real_rows(kernel_device, tiny_llama,
                                                                                   monkeypatch):
    from flare.engine.attention import allocate_kv_caches
    from flare.engine.attention_triton import TritonBackend
    from flare.engine.prompt_graphs import PromptGraphs, _check_bucket
    from flare.models import load_checkpoint

    cfg, model = load_checkpoint(tiny_llama, torch.float32, kernel_device, TritonBackend())
    caches = allocate_kv_caches(cfg, 16, 16, torch.float32, kernel_device)
    graphs = PromptGraphs(model, caches, (16, 32), capture=False)    # a CPU "replay" is the padded step itself
    faithful = _check_bucket(graphs, model, 32, range(16), 16, cfg.vocab_size)
    assert faithful.replay == 0.0 and faithful.padding < 1e-4

    real_attend = PromptGraphs._attend                    # attention one row off: the last real row reads padding

    def one_row_off(self, call, count, meta):
        self.query[:count].copy_(self.query[1:count + 1].clone())
        real_attend(self, call, count, meta)

    monkeypatch.setattr(PromptGraphs, "_attend", one_row_off)
    leaking = _check_bucket(graphs, model, 32, range(16), 16, cfg.vocab_size)
    assert leaking.padding > 1e-1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_export_check_captures_every_bucket_and_finds_the_eager_step(tiny_llama, compiled, monkeypatch):
    from flare.engine.attention import allocate_kv_caches
    from flare.engine.attention_triton import TritonBackend
    from flare.engine.compile import compile_model
    from flare.engine.prompt_graphs import PromptGraphs, check_prompt_graphs, pages_to_check
    from flare.models import load_checkpoint

    cfg, model = load_checkpoint(tiny_llama, torch.bfloat16, "cuda", TritonBackend())
    if compiled:
        compile_model(model)
    caches = allocate_kv_caches(cfg, 64, 16, torch.bfloat16, "cuda")
    sizes = (16, 32, 64, 256)
    assert pages_to_check(256, 16) == 3 + 19 <= 64              # a decode over 37 cached, 252 new over 37
    check = check_prompt_graphs(model, caches, sizes, range(64), 16, cfg.vocab_size)
    assert check.sizes == sizes, check.note
    assert check.note.startswith("replays match the eager step") and check.graphs.sizes == sizes

    monkeypatch.setattr(PromptGraphs, "_attend", lambda self, call, count, meta: None)   # attention left out
    broken = check_prompt_graphs(model, caches, sizes, range(64), 16, cfg.vocab_size)
    assert broken.sizes == () and broken.note.startswith("not captured: padding changes the eager step")

    real_run = PromptGraphs.run                                                            # a stale replay
    monkeypatch.undo()
    monkeypatch.setattr(PromptGraphs, "run", lambda self, ids, positions, meta: real_run(self, ids.flip(0), positions, meta))
    stale = check_prompt_graphs(model, caches, sizes, range(64), 16, cfg.vocab_size)
    assert stale.sizes == () and stale.note.startswith("not captured: a replay differs from the eager step")
