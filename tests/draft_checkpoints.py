"""Draft checkpoints for the speculation tests, made from a trained target (never random weights).

`with_draft(target, draft, into)`: a copy of the target checkpoint directory that supplies `draft` in
`draft/` (flare.engine.speculation.settings.supplied_draft); tests use tests/fixtures/stories260k-draft, distilled
from stories260k (it agrees with the target's next token two times in three).

`with_truncated_draft(target, layers, into)`: the same with a crude draft: the target's first `layers`
decoder layers, its final norm and its (tied) embedding and head, saved as a Llama checkpoint of its own.
It shares the target's vocabulary but is mostly wrong, which exercises rejections.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def truncated_draft(target: Path, layers: int, into: Path) -> Path:
    """Write the draft checkpoint (config.json, model.safetensors) into `into`; returns it."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"a draft keeps 1 to {config['num_hidden_layers'] - 1} of the target's layers")
    tensors = load_file(str(target / "model.safetensors"))
    kept = {name: tensor for name, tensor in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    into.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in kept.items()}, str(into / "model.safetensors"))
    (into / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    return into


STORIES_DRAFT = Path(__file__).resolve().parent / "fixtures" / "stories260k-draft"


def with_draft(target: Path, draft: Path, into: Path) -> Path:
    """A copy of `target` that supplies the checkpoint `draft` in `draft/`."""
    into.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():
        if item.is_file():
            shutil.copy2(item, into / item.name)
    shutil.copytree(draft, into / "draft", dirs_exist_ok=True)
    return into


def with_truncated_draft(target: Path, layers: int, into: Path) -> Path:
    """A copy of `target` (links to its files) that supplies a truncated draft in `draft/`."""
    into.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():
        if item.is_file():
            shutil.copy2(item, into / item.name)
    truncated_draft(target, layers, into / "draft")
    return into
