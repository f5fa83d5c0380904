"""FP8 accuracy on trained models (CPU): how often FP8 predicts the unquantized model's next token.

For each model and each FP8 variant, text is fed teacher-forced through the paged cache (chunks of 32
tokens, so later tokens read earlier ones back from the cache as decoding does) and compared position
by position with the unquantized model on the same text:
  * top-1 agreement: the variant's most likely next token is the unquantized model's (and the bf16
    model's, the comparison the issue's targets name);
  * perplexity of the text under each, and its change;
  * mean KL divergence from the unquantized distribution (nats per token).
The unquantized model is the checkpoint in float32 (both are float32-trained); "bf16", the same weights
rounded to bfloat16 as a GPU serves them, is the yardstick for what rounding alone costs. Variants: FP8 weights (`--online-mxfp8`: the decoder projections as e4m3 in 128x128 blocks with float32
scales), and FP8 weights + FP8 KV cache (`--kv-cache-dtype fp8`: e4m3 with a float32 scale per token and
KV head). Both run the torch reference of the kernels, which compute the same functions on the GPU
(weight-only FP8: activations stay in the serving dtype).

Models: the stories260k fixture (text: short children's stories written for this benchmark, in the
style of its training data), the built-in demo model (text: the held-out part of its Python
documentation corpus, which it never trained on; built on first use, a few minutes), and "gpu-trained":
a wider model (512 wide, 8 layers, 64-wide heads) trained on the GPU for a few minutes from the demo's
corpus by the demo's own pipeline, measured on the same held-out documents.

With --device cuda every variant runs in bfloat16 on the GPU through the serving kernels (the FP8 GEMV
and GEMM, the attention kernels reading the FP8 cache) and "bf16" is the dense model there, the
yardstick the issue's targets name; the float32 reference runs on the CPU. --chunk 1 feeds every token
as a decode step (GEMV, decode attention); the default 32-token chunks take the prompt path.

    python benchmarks/fp8_accuracy.py --out benchmarks/results/fp8_accuracy.json
    python3 benchmarks/fp8_accuracy.py --device cuda --models gpu-trained --out $OUT/fp8_accuracy_gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from flare.demo.spec import DemoSpec  # noqa: E402
from flare.engine.attention import AttentionMetadata, TorchReferenceBackend, allocate_kv_caches  # noqa: E402
from flare.engine.factory import attention_backend  # noqa: E402
from flare.models import load_checkpoint  # noqa: E402
from flare.models.quantization import DECODER_PROJECTIONS  # noqa: E402

STORIES260K = REPO / "tests" / "fixtures" / "stories260k"
CHUNK = 32
PAGE_SIZE = 16
# The gpu-trained model: the demo's corpus, tokenizer and training loop at a width where 128x128 blocks and
# 64-wide heads are what real models have (512 wide, MLP 1,536: 4 and 12 blocks), about 26M parameters.
GPU_SPEC = DemoSpec(vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                    intermediate_size=1536, max_position_embeddings=1024, sequence_length=512, batch_size=8,
                    steps=1500, learning_rate=1e-3, warmup_steps=100, log_every=250)
# "bf16" is the yardstick: the same model merely rounded to bfloat16, as it is served on a GPU.
VARIANTS = {
    "bf16": {"dtype": torch.bfloat16},
    "fp8 weights": {"online_fp8": DECODER_PROJECTIONS},
    "fp8 weights + fp8 kv": {"online_fp8": DECODER_PROJECTIONS, "kv_cache_dtype": "fp8"},
    "fp8 kv": {"kv_cache_dtype": "fp8"},
}
STORIES = [
    "Once upon a time, there was a little girl named Mia. She had a red ball that she loved very much. Every "
    "day she played with the ball in the park near her house. One day, the ball rolled into a big puddle. Mia "
    "was sad because her ball was dirty. Her mom came and said, \"Don't worry, we can wash it.\" They went home "
    "and washed the ball with warm water and soap. Soon the ball was red and shiny again. Mia smiled and hugged "
    "her mom. Then she went back to the park to play.",
    "Tom was a small dog who liked to run. He ran in the garden and he ran in the street. One morning Tom saw a "
    "cat sitting on a wall. The cat looked at Tom and said, \"Why do you always run?\" Tom said, \"Because it is "
    "fun!\" The cat jumped down and ran with Tom. They ran to the river and back. When they were tired, they "
    "sat under a tree and rested. From that day on, Tom and the cat were best friends.",
    "Lily wanted to bake a cake for her dad. She got flour, eggs and sugar from the kitchen. Her brother Ben "
    "helped her mix everything in a big bowl. They put the cake in the oven and waited. The kitchen smelled "
    "sweet and warm. When the cake was ready, they put pink frosting on top. Dad came home and saw the cake. "
    "He was very happy and said thank you. They all ate the cake together and laughed.",
    "There was a little bird who could not fly. The other birds flew high in the sky, but the little bird "
    "stayed on the ground. One day a kind boy found the bird. He gave it some water and seeds. Every day the "
    "boy came back to help. The bird got stronger and stronger. One morning the bird flapped its wings and "
    "flew up into the tree. The boy clapped his hands. The bird sang a happy song for him.",
    "Sam had a new blue boat. He took it to the pond with his grandpa. They put the boat on the water and "
    "watched it float. The wind pushed the boat far away. Sam was scared that the boat would be lost. Grandpa "
    "took a long stick and pulled the boat back. Sam said, \"Thank you, Grandpa!\" They played with the boat "
    "until the sun went down. Then they walked home and had soup for dinner.",
    "Anna found a shiny stone in the sand. It was smooth and bright like the moon. She showed it to her friend "
    "Max. Max said, \"Let's look for more!\" They looked all day and found many stones. Some were white, some "
    "were grey and one was green. They put all the stones in a jar. At night the jar sat by the window. Anna "
    "looked at the stones before she went to sleep and dreamed of the beach.",
]


def stories_text() -> list[str]:
    return STORIES


def demo_text(limit_documents: int = 12) -> tuple[Path, list[str]]:
    """The demo checkpoint (built if missing) and its held-out documents."""
    from flare.demo import ensure_demo_checkpoint
    from flare.demo.corpus import collect_documents, document_text, split_held_out
    from flare.resolve import DEMO_CACHE

    directory = Path(ensure_demo_checkpoint(DEMO_CACHE.expanduser()))
    _, held_out = split_held_out(collect_documents())
    return directory, [document_text(document) for document in held_out[:limit_documents]]


def gpu_trained(directory: Path, spec: DemoSpec = GPU_SPEC, device: str = "cuda") -> tuple[Path, list[str], dict]:
    """The gpu-trained checkpoint in `directory` (`spec` trained on `device` on first use, reused after),
    the demo corpus's held-out documents, and what its training measured."""
    from flare.demo import corpus
    from flare.demo.tokenizer import train_tokenizer, write_tokenizer_files
    from flare.demo.train import mean_loss, new_model, token_stream, train

    training, held_out = corpus.split_held_out(corpus.collect_documents())
    held_out_texts = [corpus.document_text(document) for document in held_out]
    record = directory / "training.json"
    if not record.is_file() or json.loads(record.read_text())["spec"] != spec.as_dict():
        texts = corpus.training_texts(training, spec.seed)
        tokenizer = train_tokenizer(texts, spec.vocab_size)
        stream, held_out_stream = token_stream(tokenizer, texts), token_stream(tokenizer, held_out_texts)
        torch.backends.cuda.matmul.allow_tf32 = True                 # float32 weights, TF32 products
        model = new_model(spec, tokenizer).to(device)
        untrained = mean_loss(model, held_out_stream, spec.sequence_length)
        started = time.monotonic()
        train(model, stream, spec, lambda line: print(line.replace("demo:", "gpu-trained:"), flush=True))
        seconds = time.monotonic() - started
        loss = mean_loss(model, held_out_stream, spec.sequence_length)
        directory.mkdir(parents=True, exist_ok=True)
        model.cpu().save_pretrained(directory)             # config.json, model.safetensors (float32, tied head)
        write_tokenizer_files(tokenizer, directory, spec.max_position_embeddings)
        parameters = sum(p.numel() for p in model.parameters())
        record.write_text(json.dumps({
            "spec": spec.as_dict(), "parameters": parameters, "corpus_tokens": len(stream),
            "training_seconds": round(seconds, 1), "held_out_loss": round(loss, 4),
            "untrained_held_out_loss": round(untrained, 4),
            "device": torch.cuda.get_device_name() if device == "cuda" else device}, indent=2))
    training_record = json.loads(record.read_text())
    print(f"gpu-trained: {training_record['parameters'] / 1e6:.1f}M parameters, "
          f"{training_record['training_seconds']}s of training, held-out loss {training_record['held_out_loss']} "
          f"(untrained {training_record['untrained_held_out_loss']})", flush=True)
    return directory, held_out_texts, training_record


def tokenize(directory: Path, texts: list[str], max_len: int) -> list[list[int]]:
    from flare.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(directory)
    sequences = [tokenizer.encode(text)[:max_len] for text in texts]
    return [ids for ids in sequences if len(ids) > 8]


@torch.no_grad()
def sequence_logits(cfg, model, ids: list[int], dtype=torch.float32, device: str = "cpu",
                    chunk: int = CHUNK) -> torch.Tensor:
    """float32 logits [len(ids), V] (on the CPU) of a sequence fed through the paged cache in `chunk`-token
    steps: later tokens read the earlier ones back from the cache, as decoding does."""
    pages = -(-len(ids) // PAGE_SIZE)
    caches = allocate_kv_caches(cfg, pages, PAGE_SIZE, dtype, device)
    rows = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        meta = AttentionMetadata.build([len(piece)], [start + len(piece)], [list(range(pages))], PAGE_SIZE,
                                       device=device)
        hidden = model(torch.tensor(piece, device=device), meta.positions(), caches, meta)
        rows.append(model.compute_logits(hidden).float().cpu())
    return torch.cat(rows)


def compare(reference: list[torch.Tensor], variant: list[torch.Tensor], sequences: list[list[int]],
            bf16: list[torch.Tensor]) -> dict:
    agree = agree_bf16 = positions = 0
    nll_reference = nll_variant = kl = 0.0
    for ref, var, ids, rounded in zip(reference, variant, sequences, bf16):
        targets = torch.tensor(ids[1:])
        ref_logp, var_logp = ref[:-1].log_softmax(-1), var[:-1].log_softmax(-1)
        agree += int((ref[:-1].argmax(-1) == var[:-1].argmax(-1)).sum())
        agree_bf16 += int((rounded[:-1].argmax(-1) == var[:-1].argmax(-1)).sum())
        positions += len(targets)
        nll_reference -= float(ref_logp.gather(1, targets[:, None]).sum())
        nll_variant -= float(var_logp.gather(1, targets[:, None]).sum())
        kl += float((ref_logp.exp() * (ref_logp - var_logp)).sum())
    ppl_reference, ppl_variant = math.exp(nll_reference / positions), math.exp(nll_variant / positions)
    return {"positions": positions, "top1_agreement": agree / positions,
            "top1_agreement_with_bf16": agree_bf16 / positions, "perplexity": ppl_variant,
            "reference_perplexity": ppl_reference, "perplexity_change_pct": 100 * (ppl_variant / ppl_reference - 1),
            "mean_kl_nats": kl / positions}


def evaluate(directory: Path, texts: list[str], max_len: int, device: str = "cpu", chunk: int = CHUNK) -> dict:
    """Every variant against the float32 model (on the CPU). On "cuda" the variants run in bfloat16 through
    the GPU kernels; on the CPU in float32 (their "bf16" in bfloat16) through the torch reference."""
    cfg, model = load_checkpoint(directory, torch.float32, "cpu", TorchReferenceBackend())
    sequences = tokenize(directory, texts, min(max_len, cfg.max_position_embeddings))
    reference = [sequence_logits(cfg, model, ids) for ids in sequences]      # float32: chunking changes nothing
    results = {"checkpoint": str(directory), "sequences": len(sequences), "tokens": sum(map(len, sequences)),
               "variants": {}}
    serving_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for variant, precision in VARIANTS.items():
        precision = dict(precision)
        dtype = precision.pop("dtype", serving_dtype)
        variant_cfg, variant_model = load_checkpoint(directory, dtype, device, attention_backend(device, cfg.head_dim),
                                                     **precision)
        logits = [sequence_logits(variant_cfg, variant_model, ids, dtype, device, chunk) for ids in sequences]
        bf16 = logits if variant == "bf16" else bf16                # "bf16" comes first
        results["variants"][variant] = compare(reference, logits, sequences, bf16)
    return results


def print_table(results: dict) -> None:
    print(f"{'model':<12} {'variant':<22} {'tokens':>7} {'top-1':>8} {'vs bf16':>8} {'ppl':>9} {'ppl ref':>9} "
          f"{'change':>8} {'KL':>9}")
    for model, result in results["models"].items():
        for variant, row in result["variants"].items():
            print(f"{model:<12} {variant:<22} {row['positions']:>7} {100 * row['top1_agreement']:>7.2f}% "
                  f"{100 * row['top1_agreement_with_bf16']:>7.2f}% "
                  f"{row['perplexity']:>9.3f} {row['reference_perplexity']:>9.3f} "
                  f"{row['perplexity_change_pct']:>+7.2f}% {row['mean_kl_nats']:>9.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["stories260k", "demo"],
                        choices=["stories260k", "demo", "gpu-trained"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the variants run (cuda: bfloat16 through the serving kernels)")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="tokens per step through the cache (1: decode)")
    parser.add_argument("--max-len", type=int, default=512, help="tokens per sequence at most")
    parser.add_argument("--documents", type=int, default=None,
                        help="evaluate the first N texts of each model only (default: all; with --chunk 1 "
                             "every token is its own step, so a GPU run over all 63 held-out documents is long)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flare-fp8-accuracy"),
                        help="where the gpu-trained checkpoint is trained once and kept")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if "gpu-trained" in args.models and not torch.cuda.is_available():
        parser.error("gpu-trained is trained on the GPU: run it where CUDA is available")
    torch.manual_seed(0)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    device = (f"cuda ({torch.cuda.get_device_name()}, serving kernels in bfloat16)" if args.device == "cuda"
              else "cpu (torch reference of the FP8 kernels)")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "commit": commit, "device": device, "torch": torch.__version__, "chunk_tokens": args.chunk,
               "documents_per_model": args.documents or "all",
               "models": {}}
    for model in args.models:
        training = None
        if model == "stories260k":
            directory, texts = STORIES260K, stories_text()
        elif model == "demo":
            directory, texts = demo_text()
        else:
            directory, texts, training = gpu_trained(args.work / "gpu-trained")
        texts = texts[:args.documents] if args.documents else texts
        results["models"][model] = evaluate(directory, texts, args.max_len, args.device, args.chunk)
        if training:
            results["models"][model]["training"] = training
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
