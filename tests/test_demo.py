"""The built-in demo model: tokenizer, chat template, checkpoint format, reproducible cached builds, learning.

The tests build the reduced demo (same pipeline, tiny model, a few seconds of training).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flare.demo import DemoSpec, ensure_demo_checkpoint, is_complete_build
from flare.demo import build as demo_build
from flare.demo import train as demo_train
from flare.demo.corpus import collect_documents, document_text, split_held_out
from flare.demo.tokenizer import render_chat

SPEC = DemoSpec.reduced()
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
    {"role": "user", "content": "And a tuple?"},
]


@pytest.fixture(autouse=True, scope="module")
def one_training_thread():
    """The tiny test model gains nothing from a second thread, and a busy machine makes two slow."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo_train, "training_threads", lambda: 1)
        yield


@pytest.fixture(scope="module")
def documents():
    return collect_documents()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory, one_training_thread) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint", SPEC, log=lambda line: None)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_importing_the_package_does_not_import_torch():
    code = "import sys, flare.demo; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_checkpoint_has_the_hugging_face_files(demo_dir):
    for name in demo_build.CHECKPOINT_FILES:
        assert (demo_dir / name).is_file(), name
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    card = (demo_dir / "README.md").read_text()
    assert "not an assistant" in card and "PSF" in card


def test_tokenizer_round_trips_text(demo_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    for text in [
        "Return a new list.",
        "def f(x):\n    return x ** 2  # square\n\n\tdone",
        "naïve café — 東京 🐍 “quotes” \x00 end  ",
        "",
    ]:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_tokens(demo_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>").ids
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert ids[-2:] == [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]


def test_chat_template_renders_system_user_and_assistant_turns(demo_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    expected = (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\nWhat is a list?<|im_end|>\n"
        "<|im_start|>assistant\nA mutable sequence.<|im_end|>\n"
        "<|im_start|>user\nAnd a tuple?<|im_end|>\n"
    )
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False)
    prompted = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert prompted == expected + "<|im_start|>assistant\n"
    assert render_chat(CONVERSATION, add_generation_prompt=True) == prompted  # the text we trained on


def test_chat_template_accepts_content_as_text_parts():
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "a set?"}]}]
    assert render_chat(parts) == "<|im_start|>user\nWhat is a set?<|im_end|>\n"


def test_checkpoint_loads_and_generates_with_transformers(demo_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    end_ids = set(model.generation_config.eos_token_id)
    assert end_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert output.shape[1] > prompt["input_ids"].shape[1]


def test_trained_model_predicts_held_out_documentation_far_better_than_untrained(demo_dir, documents):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    _, held_out = split_held_out(documents)
    ids = tokenizer("\n\n".join(document_text(d) for d in held_out[:20]))["input_ids"]
    windows = torch.tensor(ids[: len(ids) // 64 * 64]).view(-1, 64)

    def loss(model) -> float:
        with torch.no_grad():
            return model(input_ids=windows, labels=windows).loss.item()

    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo_dir))
    trained = AutoModelForCausalLM.from_pretrained(demo_dir)
    assert loss(trained) < loss(untrained) - 1.5


def test_same_seed_builds_identical_files(demo_dir, tmp_path):
    lines: list[str] = []
    again = ensure_demo_checkpoint(tmp_path / "again", SPEC, log=lines.append)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert sha256(again / name) == sha256(demo_dir / name), name
    assert any(line.startswith(f"demo: step {SPEC.steps}/{SPEC.steps}") for line in lines)  # progress


def test_weights_do_not_depend_on_the_thread_count(demo_dir, documents):
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    stream = demo_train.token_stream(tokenizer, [document_text(d) for d in documents[:100]])
    spec = DemoSpec(steps=1, batch_size=2, sequence_length=64, warmup_steps=1)  # the served model's shape
    weights = []
    for threads in (1, 2):
        with demo_train.fixed_threads(threads):
            model = demo_train.new_model(spec, tokenizer)
            demo_train.train(model, stream, spec, log=lambda line: None)
        weights.append(model.state_dict())
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name


def test_corpus_does_not_depend_on_what_this_process_imported(documents):
    import transformers  # noqa: F401  (patches logging.Logger, as torch patches inspect)

    assert collect_documents() == documents
    assert {"topic", "module", "class", "function"} == {d.kind for d in documents}


def test_complete_build_is_reused_without_work(demo_dir, monkeypatch):
    def refuse(*args):
        raise AssertionError("a complete build must not be rebuilt")

    monkeypatch.setattr(demo_build, "build_checkpoint", refuse)
    before = sha256(demo_dir / "model.safetensors")
    assert ensure_demo_checkpoint(demo_dir, SPEC) == demo_dir
    assert sha256(demo_dir / "model.safetensors") == before


def fake_build(calls: list):
    """A stand-in for the real build that writes placeholder files and counts its calls."""

    def build(directory: Path, spec: DemoSpec, log) -> None:
        calls.append(directory)
        for name in demo_build.CHECKPOINT_FILES:
            (directory / name).write_text("placeholder")
        demo_build._write_marker(directory, spec, 0.0, 0.0)

    return build


def test_a_different_spec_or_an_unfinished_directory_is_rebuilt(tmp_path, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(demo_build, "build_checkpoint", fake_build(calls))
    target = tmp_path / "demo"
    target.mkdir()
    (target / "model.safetensors").write_text("half written")  # no marker: not a finished build
    ensure_demo_checkpoint(target, SPEC)
    assert is_complete_build(target, SPEC) and (target / "model.safetensors").read_text() == "placeholder"
    other = DemoSpec.reduced(seed=1)
    assert not is_complete_build(target, other)
    ensure_demo_checkpoint(target, other)
    assert is_complete_build(target, other) and len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo", "demo.lock"]  # no staging left behind


def test_failed_build_leaves_nothing_half_written(tmp_path, monkeypatch):
    def crash(directory: Path, spec, log):
        (directory / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(demo_build, "build_checkpoint", crash)
    with pytest.raises(RuntimeError):
        ensure_demo_checkpoint(tmp_path / "demo", SPEC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.lock"]


def test_concurrent_callers_build_once(tmp_path, monkeypatch):
    calls: list[Path] = []
    started = threading.Barrier(4)
    build = fake_build(calls)

    def slow_build(directory, spec, log):
        threading.Event().wait(0.2)  # long enough for the other callers to reach the lock
        build(directory, spec, log)

    monkeypatch.setattr(demo_build, "build_checkpoint", slow_build)

    def call():
        started.wait()
        ensure_demo_checkpoint(tmp_path / "demo", SPEC)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and is_complete_build(tmp_path / "demo", SPEC)
