"""Make tests/fixtures/stories260k-draft: a two-layer draft model distilled from stories260k.

    PYTHONPATH=src python tests/make_stories_draft.py [--steps 400] [--output tests/fixtures/stories260k-draft]

The draft starts from the target's embedding, first two decoder layers and final norm (a truncated copy
on its own agrees with the target's next token about 6% of the time), then learns, in a few minutes of
one CPU core, to match the target's next-token distribution (KL divergence) on stories the target
sampled itself. It keeps the target's tokenizer and vocabulary, so it can draft for it. The script is
deterministic (fixed seeds), prints the greedy agreement with the target on held-out stories, and
writes config.json and model.safetensors.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
TARGET = ROOT / "fixtures" / "stories260k"
LAYERS = 2


def sample_stories(target, count: int, length: int, seed: int) -> torch.Tensor:
    """[count, length] token ids: stories the target writes from <s> at temperature 1."""
    torch.manual_seed(seed)
    start = torch.full((count, 1), target.config.bos_token_id, dtype=torch.long)
    with torch.no_grad():
        return target.generate(start, do_sample=True, temperature=1.0, top_k=0, max_length=length,
                               min_length=length, pad_token_id=0)


def make_draft(target):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": LAYERS})
    draft = LlamaForCausalLM(config)
    state = {name: tensor for name, tensor in target.state_dict().items()
             if not name.startswith("model.layers.") or int(name.split(".")[2]) < LAYERS}
    draft.load_state_dict(state, strict=False)
    return draft


def agreement(draft, target, stories: torch.Tensor) -> float:
    with torch.no_grad():
        return (draft(stories).logits.argmax(-1) == target(stories).logits.argmax(-1)).float().mean().item()


def train(draft, target, stories: torch.Tensor, steps: int, batch: int) -> None:
    with torch.no_grad():
        teacher = torch.log_softmax(target(stories).logits, dim=-1)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        index = torch.randint(0, stories.shape[0], (batch,), generator=generator)
        student = torch.log_softmax(draft(stories[index]).logits, dim=-1)
        loss = torch.nn.functional.kl_div(student, teacher[index], log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step}: KL {loss.item() / stories.shape[1]:.3f} per token", flush=True)


def main() -> int:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--output", type=Path, default=ROOT / "fixtures" / "stories260k-draft")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    target = LlamaForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    stories, held_out = sample_stories(target, 256, 128, seed=1), sample_stories(target, 32, 128, seed=2)
    draft = make_draft(target)
    print(f"truncated draft agrees with the target on {agreement(draft, target, held_out):.1%} of next tokens")
    train(draft, target, stories, args.steps, batch=32)
    print(f"trained draft agrees on {agreement(draft, target, held_out):.1%} ({time.perf_counter() - started:.0f} s)")
    args.output.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous() for name, tensor in draft.state_dict().items()
               if name != "lm_head.weight"}                        # tied to the embedding, as the target's
    save_file(tensors, str(args.output / "model.safetensors"))
    config = json.loads((TARGET / "config.json").read_text())
    (args.output / "config.json").write_text(json.dumps({**config, "num_hidden_layers": LAYERS}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
