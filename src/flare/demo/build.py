"""Build the demo checkpoint once, into a cache directory, and reuse it afterwards.

The build runs in a temporary sibling directory and is renamed into place when complete, under a
file lock, so a crash leaves no half-written checkpoint and two processes never both train. A
complete build carries a marker (`demo-build.json`) naming the builder version and the spec; a
directory whose marker matches is reused without any work.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from flare.demo.spec import BUILDER_VERSION, DemoSpec
from flare.errors import PreparationError

MARKER = "demo-build.json"
CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "README.md",
)

Log = Callable[[str], None]


def ensure_demo_checkpoint(directory: Path, spec: DemoSpec = DemoSpec(), log: Log | None = None) -> Path:
    """Return `directory` holding the built demo checkpoint, building it first if needed.

    A complete build of the same builder version and spec is reused at once. Otherwise the model is
    built (a few minutes on two CPU cores for the default spec), with progress lines sent to `log`
    (standard error by default).
    """
    directory = Path(directory)
    log = log or _print_to_stderr
    if is_complete_build(directory, spec):
        return directory
    from filelock import FileLock

    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(directory.with_name(directory.name + ".lock"))):
            if not is_complete_build(directory, spec):  # another process may have built it meanwhile
                _build_in_place(directory, spec, log)
    except OSError as error:
        raise PreparationError(
            f"could not build the demo model in {directory}: {error}; "
            "free some disk space or point the model cache at a writable directory"
        ) from error
    return directory


def is_complete_build(directory: Path, spec: DemoSpec) -> bool:
    """Whether `directory` holds a finished build of this builder version and `spec`."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        marker.get("builder_version") == BUILDER_VERSION
        and marker.get("spec") == spec.as_dict()
        and all((Path(directory) / name).is_file() for name in CHECKPOINT_FILES)
    )


def _build_in_place(directory: Path, spec: DemoSpec, log: Log) -> None:
    """Build into a fresh sibling, then swap it in for whatever `directory` held. Caller holds the lock."""
    for stale in directory.parent.glob(f".{directory.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a build that crashed; we hold the lock
    staging = directory.with_name(f".{directory.name}.building")
    staging.mkdir()
    try:
        build_checkpoint(staging, spec, log)
        if directory.exists():
            retired = directory.with_name(f".{directory.name}.retired")
            directory.rename(retired)
            shutil.rmtree(retired, ignore_errors=True)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_checkpoint(directory: Path, spec: DemoSpec, log: Log) -> None:
    """Collect the corpus, train the tokenizer and the model, and write the checkpoint into `directory`."""
    from flare.demo import corpus
    from flare.demo.tokenizer import train_tokenizer, write_tokenizer_files
    from flare.demo.train import fixed_threads, mean_loss, new_model, token_stream, train, training_threads

    started = time.monotonic()
    log("demo: building the demo model from the Python documentation (first use only)")
    training, held_out = corpus.split_held_out(corpus.collect_documents())
    texts = corpus.training_texts(training, spec.seed)
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    stream = token_stream(tokenizer, texts)
    held_out_stream = token_stream(tokenizer, [corpus.document_text(d) for d in held_out])
    threads = training_threads()
    log(f"demo: {len(texts)} texts, {len(stream)} tokens, vocabulary {tokenizer.get_vocab_size()}, {threads} thread(s)")
    with fixed_threads(threads):
        model = new_model(spec, tokenizer)
        untrained_loss = mean_loss(model, held_out_stream, spec.sequence_length)
        train(model, stream, spec, log)
        held_out_loss = mean_loss(model, held_out_stream, spec.sequence_length)
    log(f"demo: held-out loss {held_out_loss:.3f} (untrained {untrained_loss:.3f})")

    _write_model(model, directory)
    write_tokenizer_files(tokenizer, directory, spec.max_position_embeddings)
    parameters = sum(p.numel() for p in model.parameters())
    (directory / "README.md").write_text(model_card(spec, parameters, len(stream)), encoding="utf-8")
    _write_marker(directory, spec, held_out_loss, untrained_loss)
    log(f"demo: built in {time.monotonic() - started:.0f}s")


def _write_model(model, directory: Path) -> None:
    """config.json, generation_config.json and model.safetensors (float32; the tied head is not stored)."""
    from safetensors.torch import save_file

    config = model.config.to_diff_dict()
    config.update(architectures=["LlamaForCausalLM"], dtype="float32")
    config["rope_theta"] = model.config.rope_parameters["rope_theta"]  # also at the top, for older readers
    _write_json(directory / "config.json", config)
    end_ids = [config["eos_token_id"], config["pad_token_id"]]
    _write_json(directory / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": end_ids,  # end of a chat turn, end of a document
        "pad_token_id": config["pad_token_id"],
    })
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    tensors.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)  # save_file creates it private; the other files are not


def _write_marker(directory: Path, spec: DemoSpec, held_out_loss: float, untrained_loss: float) -> None:
    files = {name: _sha256(directory / name) for name in CHECKPOINT_FILES}
    _write_json(directory / MARKER, {
        "builder_version": BUILDER_VERSION,
        "spec": spec.as_dict(),
        "python_version": sys.version.split()[0],  # the corpus is this Python's documentation
        "held_out_loss": round(held_out_loss, 4),
        "untrained_held_out_loss": round(untrained_loss, 4),
        "files": files,
    })


def model_card(spec: DemoSpec, parameters: int, training_tokens: int) -> str:
    """The README.md of the checkpoint: what it is, what it is not, and its license."""
    trained_tokens = spec.steps * spec.batch_size * spec.sequence_length
    return f"""---
license: other
license_name: psf-2.0
license_link: https://docs.python.org/3/license.html
tags:
- demo
- llama
---

# Flare demo model

**This is a demonstration model, not an assistant.** It is a tiny Llama-architecture language
model ({parameters / 1e6:.1f} million parameters) that Flare builds on first use, locally and without
a network, so that `ignition export` and `flare run` can be tried on any machine. Its replies
imitate the wording of the Python documentation; they are often wrong, repetitive or off the point.
Do not rely on anything it says.

## How it was made

* **Text:** the documentation that ships with CPython {sys.version.split()[0]}: the reference-manual
  topics in `pydoc_data.topics` and the docstrings of common standard-library modules, plus short
  question-and-answer exchanges made from the first sentences of those documents.
* **Tokenizer:** byte-level BPE with {spec.vocab_size} entries, trained on that text with the
  `tokenizers` library. Special tokens: `<|endoftext|>` (between documents), `<|im_start|>` and
  `<|im_end|>` (chat turns).
* **Model:** LlamaForCausalLM, hidden size {spec.hidden_size}, {spec.num_layers} layers,
  {spec.num_heads} attention heads sharing {spec.num_kv_heads} key/value heads, context
  {spec.max_position_embeddings} tokens, tied input and output embeddings, float32.
* **Training:** {spec.steps} steps of {spec.batch_size} windows of {spec.sequence_length} tokens
  ({trained_tokens:,} tokens seen; the corpus holds {training_tokens:,}) on the CPU with seed
  {spec.seed}. It never saw more than {spec.sequence_length} tokens at once: well beyond that
  length, its text falls apart.

## Chat format

The chat template (in `tokenizer_config.json`) writes each turn as
`<|im_start|>ROLE\\nTEXT<|im_end|>\\n` for the roles `system`, `user` and `assistant`; with
`add_generation_prompt` it ends with `<|im_start|>assistant\\n`. Generation stops at `<|im_end|>`
or `<|endoftext|>`.

## License

The training text is the Python documentation, Copyright © 2001 Python Software Foundation, used
under the PSF License Agreement (PSF-2.0), see https://docs.python.org/3/license.html. This model
and its tokenizer are derived from that text and are distributed under the same terms.
"""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
