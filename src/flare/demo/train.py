"""Train the demo model: a small LlamaForCausalLM, briefly, on the CPU, with plain PyTorch. Training
runs where the model is: benchmarks/fp8_accuracy.py trains a wider one on the GPU the same way.

Reproducible: fixed seeds and batches drawn from a seeded generator; the weights come out
bit-identical with one or two threads (a test checks this), so the thread count is chosen for speed
alone. The caller's thread setting is restored.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from typing import Callable

from flare.demo.spec import DemoSpec
from flare.demo.tokenizer import END_OF_TEXT, TURN_END



def model_config(spec: DemoSpec, tokenizer):
    """The transformers `LlamaConfig` of the demo model for `tokenizer`'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(END_OF_TEXT),
        eos_token_id=tokenizer.token_to_id(TURN_END),
        pad_token_id=tokenizer.token_to_id(END_OF_TEXT),
    )


def token_stream(tokenizer, texts: list[str]):
    """All texts as one 1-D tensor of token ids, each text followed by the end-of-text token."""
    import torch

    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(end_of_text)
    return torch.tensor(ids, dtype=torch.long)


def training_threads() -> int:
    """Two threads when a second core is free, else one.

    When the cores are busy with other work (a test run with two workers, say), two threads wait for
    each other at every small operation: measured here, 9 s a step against 1.2 s for one thread.
    """
    cores = os.cpu_count() or 1
    return 2 if cores - os.getloadavg()[0] >= 1.5 else 1


@contextmanager
def fixed_threads(count: int):
    """Run torch on exactly `count` threads inside the block, then restore the caller's setting."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def new_model(spec: DemoSpec, tokenizer):
    """An untrained demo model, initialised from `spec.seed`."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(model_config(spec, tokenizer)).float()


def train(model, stream, spec: DemoSpec, log: Callable[[str], None]) -> None:
    """Train `model` in place for `spec.steps` steps on random windows of `stream`, on the model's device."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed)          # on the CPU, wherever the model is
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _learning_rate_factor(step, spec))
    model.train()
    started = time.monotonic()
    for step in range(1, spec.steps + 1):
        inputs = _random_windows(stream, spec, generator).to(device)
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step % spec.log_every == 0 or step == spec.steps:
            log(f"demo: step {step}/{spec.steps}  loss {loss.item():.3f}  {time.monotonic() - started:.1f}s")
    model.eval()


def mean_loss(model, stream, sequence_length: int) -> float:
    """Mean next-token cross-entropy of `model` over `stream`, in consecutive windows."""
    import torch

    usable = (len(stream) // sequence_length) * sequence_length
    windows = stream[:usable].view(-1, sequence_length)
    losses = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in windows.split(16):
            batch = batch.to(device)
            losses.append(model(input_ids=batch, labels=batch).loss.item() * len(batch))
    return sum(losses) / len(windows)


def _random_windows(stream, spec: DemoSpec, generator):
    import torch

    starts = torch.randint(0, len(stream) - spec.sequence_length, (spec.batch_size,), generator=generator)
    return torch.stack([stream[start : start + spec.sequence_length] for start in starts.tolist()])


def _learning_rate_factor(step: int, spec: DemoSpec) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
