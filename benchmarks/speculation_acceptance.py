#!/usr/bin/env python
"""Acceptance of speculative drafts on trained models: how many drafts the target keeps, by position.

    python benchmarks/speculation_acceptance.py --out results/speculation_acceptance_cpu.json
    python benchmarks/speculation_acceptance.py --device cuda --gpu-trained /tmp/spec-trained \
        --out $OUT/speculation_acceptance_gpu.json

On the CPU (default) the target is stories260k and the draft model tests/fixtures/stories260k-draft
(two layers distilled from it). With --gpu-trained DIR a target (8 layers, 512 wide) and a draft model
(2 layers, 256 wide, the same tokenizer) are trained on the GPU from the demo's corpus (Python's
documentation; within about three minutes together; reused from DIR when present) and measured on
held-out documents. Never random weights: their acceptance means nothing.

Each method runs through the engine as served (flare.engine: scheduler, runner, verification), at a fixed
width of --drafts drafts so every position is measured: history drafts, the draft model, both. Two prompt
sets: plain (a text's opening) and repeating (a text, then its beginning again, as answers that quote
their prompt do). Greedy and sampled (temperature 0.8). Reports per position the rate at which a
reached draft is accepted, the mean tokens per verification round (accepted + 1) and the tokens per
target step overall, and checks that greedy output with drafts equals the output without. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

STORIES_TARGET = REPO / "tests" / "fixtures" / "stories260k"
STORIES_DRAFT = REPO / "tests" / "fixtures" / "stories260k-draft"
OPENINGS = ["Once upon a time, there was a little girl named Mia.", "Tom was a small dog who liked to run.",
            "Lily wanted to bake a cake for her dad.", "There was a little bird who could not fly.",
            "Sam had a new blue boat.", "Anna found a shiny stone in the sand."]


def stories_prompts() -> tuple[list[str], list[str]]:
    """Plain openings, and openings followed by a short story and that story's start again."""
    repeating = [f"{text} She said hello to her friend. {text} She said" for text in OPENINGS]
    return OPENINGS, repeating


def corpus_prompts(count: int = 12, words: int = 60) -> tuple[list[str], list[str]]:
    from flare.demo import corpus

    _, held_out = corpus.split_held_out(corpus.collect_documents())
    texts = [" ".join(corpus.document_text(document).split()[:words]) for document in held_out[:count]]
    repeating = [f"{text}\n\n{' '.join(text.split()[:words // 3])}" for text in texts]
    return [" ".join(text.split()[:words // 2]) for text in texts], repeating


METHODS = {"history": dict(history=True), "draft model": dict(draft_model=True),
           "both": dict(history=True, draft_model=True)}


def run_method(directory: Path, method: str, prompts: list[str], params, drafts: int, device: str,
               plain_ids: list[list[int]] | None):
    from flare.engine.config import EngineConfig
    from flare.engine.speculation.settings import SpeculationSettings
    from flare.engine_client.llm_engine import LLMEngine

    settings = SpeculationSettings(draft_tokens=drafts, adaptive=False, **METHODS[method]) if method else SpeculationSettings()
    config = EngineConfig(max_concurrency=8, page_size=16, num_pages=512, max_model_len=1024,
                          max_num_batched_tokens=4096, prefill_chunk=1024, speculation=settings)
    llm = LLMEngine.from_checkpoint(directory, config, device=device, seed=0)
    steps = 0
    for request_id, prompt in enumerate(prompts):
        llm.add_request(str(request_id), prompt, params)
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    while llm.has_unfinished():
        for output in llm.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        steps += 1
    seconds = time.perf_counter() - started
    ids = [outputs[str(i)] for i in range(len(prompts))]
    stats = llm.core.stats()
    tokens = sum(len(row) for row in ids)
    result = {"output_tokens": tokens, "engine_steps": steps, "seconds": round(seconds, 2)}
    if method:
        rounds = stats.speculative_rounds
        reached, accepted = stats.draft_tokens_proposed_by_position, stats.draft_tokens_accepted_by_position
        result.update(rounds=rounds, drafts=stats.draft_tokens_proposed, accepted=stats.draft_tokens_accepted,
                      acceptance_by_position=[round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
                      mean_tokens_per_round=round((stats.draft_tokens_accepted + rounds) / rounds, 3) if rounds else None)
        if plain_ids is not None:
            result["greedy_equals_plain"] = ids == plain_ids
    return ids, result


def measure(directory: Path, prompt_sets: dict, drafts: int, device: str, max_tokens: int) -> dict:
    from flare.engine.sampling_params import SamplingParams

    report = {}
    for name, prompts in prompt_sets.items():
        for mode, params in (("greedy", SamplingParams(temperature=0, max_tokens=max_tokens)),
                             ("sampled", SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=7))):
            plain, baseline = run_method(directory, "", prompts, params, drafts, device, None)
            rows = {"none": baseline}
            for method in METHODS:
                _, rows[method] = run_method(directory, method, prompts, params, drafts, device,
                                             plain if mode == "greedy" else None)
            report[f"{name}, {mode}"] = rows
            print(table({f"{name}, {mode}": rows}), flush=True)
    return report


def table(report: dict) -> str:
    lines = []
    for case, rows in report.items():
        lines.append(f"{case}:")
        lines.append(f"  {'method':<12} {'rounds':>6} {'accepted/drafts':>16} {'tok/round':>9} {'tok/step':>8}  "
                     f"acceptance by position")
        for method, row in rows.items():
            per_step = row["output_tokens"] / row["engine_steps"]
            if method == "none":
                lines.append(f"  {method:<12} {'-':>6} {'-':>16} {'-':>9} {per_step:>8.2f}")
                continue
            by_position = " ".join("-" if rate is None else f"{rate:.2f}" for rate in row["acceptance_by_position"])
            same = "" if "greedy_equals_plain" not in row else ("  (= plain)" if row["greedy_equals_plain"]
                                                                  else "  (DIFFERS from plain)")
            lines.append(f"  {method:<12} {row['rounds']:>6} {row['accepted']:>7}/{row['drafts']:<8} "
                         f"{row['mean_tokens_per_round'] or 0:>9.2f} {per_step:>8.2f}  {by_position}{same}")
    return "\n".join(lines)


def train_gpu_pair(directory: Path) -> dict:
    """A target and a draft trained on the GPU from the demo corpus (reused when DIR holds them)."""
    import torch

    from flare.demo import corpus
    from flare.demo.spec import DemoSpec
    from flare.demo.tokenizer import train_tokenizer, write_tokenizer_files
    from flare.demo.train import mean_loss, new_model, token_stream, train

    record = directory / "training.json"
    if record.is_file():
        return json.loads(record.read_text())
    target_spec = DemoSpec(vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                           intermediate_size=1536, max_position_embeddings=1024, sequence_length=512, batch_size=8,
                           steps=1200, learning_rate=1e-3, warmup_steps=100, log_every=300)
    draft_spec = DemoSpec(vocab_size=4096, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=768, max_position_embeddings=1024, sequence_length=512, batch_size=8,
                          steps=1200, learning_rate=2e-3, warmup_steps=100, log_every=300, seed=1)
    training, held_out = corpus.split_held_out(corpus.collect_documents())
    texts = corpus.training_texts(training, 0)
    tokenizer = train_tokenizer(texts, target_spec.vocab_size)
    stream = token_stream(tokenizer, texts)
    held = token_stream(tokenizer, [corpus.document_text(document) for document in held_out])
    torch.backends.cuda.matmul.allow_tf32 = True
    found = {}
    for name, spec, where in (("target", target_spec, directory), ("draft", draft_spec, directory / "draft")):
        model = new_model(spec, tokenizer).cuda()
        started = time.monotonic()
        train(model, stream, spec, lambda line, n=name: print(line.replace("demo:", f"{n}:"), flush=True))
        found[name] = {"seconds": round(time.monotonic() - started, 1), "layers": spec.num_layers,
                       "hidden": spec.hidden_size, "held_out_loss": round(mean_loss(model, held, spec.sequence_length), 4)}
        where.mkdir(parents=True, exist_ok=True)
        model.cpu().save_pretrained(where)
    write_tokenizer_files(tokenizer, directory, target_spec.max_position_embeddings)
    found["device"] = torch.cuda.get_device_name()
    record.write_text(json.dumps(found, indent=2))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-trained", type=Path, default=None, help="train (or reuse) the GPU pair in DIR")
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--train-only", action="store_true",
                        help="with --gpu-trained: train (or reuse) the pair and stop, measuring nothing")
    args = parser.parse_args()
    if args.train_only and args.gpu_trained is None:
        parser.error("--train-only trains the --gpu-trained pair: name its directory")
    if args.gpu_trained is not None:
        training = train_gpu_pair(args.gpu_trained)
        if args.train_only:
            return 0
        directory = args.gpu_trained
        plain, repeating = corpus_prompts()
    else:
        from draft_checkpoints import with_draft

        training = {"target": "stories260k", "draft": "tests/fixtures/stories260k-draft"}
        directory = with_draft(STORIES_TARGET, STORIES_DRAFT, Path("/tmp/flare-speculation-acceptance"))
        plain, repeating = stories_prompts()
    report = measure(directory, {"plain": plain, "repeating": repeating}, args.drafts, args.device, args.max_tokens)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "speculation_acceptance", "device": args.device,
                                        "models": training, "drafts": args.drafts, "max_tokens": args.max_tokens,
                                        "fixed_width": True, "cases": report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
