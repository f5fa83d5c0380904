"""The numerics gate (GPU): Flare's serving path keeps bf16 parity with transformers on 8B-shaped models.

llama-8b's and qwen3-8b's real shapes (hidden 4096, 32 query and 8 KV heads of 128, their vocabularies
and MLP widths) cut to LAYERS decoder layers, random weights spread like tests/tiny_checkpoints.py's
(logits of a few units with clear winners). Teacher-forced: two sequences of fixed random tokens are
fed through the paged cache on the Triton backend in the steps a served model sees (a prompt, a decode
beside a prompt chunk, an extend over cached prefixes, verification-shaped steps of 4 and 9 tokens per
sequence, decodes), eagerly and with the decoder layers compiled as serving runs them (and so again with
FlashInfer's FA3 kernel computing the prompt rows, on a Hopper GPU with FlashInfer); every position's
logits are compared with transformers' float32 logits of the whole sequence.

The stated tolerance, against two yardsticks: Flare's bf16 logits are as close to float32 as
transformers' own bf16 model (SDPA attention) is, and as close as the same bf16 Flare model on the
pure-PyTorch reference attention (float32 softmax) is, so a kernel swap cannot hide behind
transformers' larger bf16 error. "As close": over all positions, the largest and the root-mean-square
deviation from float32 are at most RATIO times the yardstick's, plus SLACK of the largest float32
logit, and the argmax equals float32's at no fewer positions than the yardstick's does, less
TOP1_POINTS. `--numerics-report PATH` writes the measured deviations as JSON.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from models.paged_runner import PagedRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
LAYERS = 2
RATIO, SLACK, TOP1_POINTS = 1.5, 1e-3, 0.03
SCHEDULE = ([{"a": 500}, {"a": 1, "b": 300}, {"a": 200, "b": 200}]   # prompt, mixed step, extends
            + [{"a": 4, "b": 4}] * 4 + [{"a": 9, "b": 9}] * 2       # multi-query: a token and its drafts
            + [{"a": 1, "b": 1}] * 8)                                # decodes
SHAPES_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "shapes.py"


@dataclass(frozen=True)
class Deviation:
    """Logits `[N, V]` against the float32 reference's."""

    max_abs: float
    rms: float
    top1_agreement: float           # the fraction of positions whose argmax is the reference's

    @classmethod
    def of(cls, logits: torch.Tensor, reference: torch.Tensor) -> Deviation:
        difference = (logits - reference).double()
        return cls(max_abs=float(difference.abs().max()), rms=float(difference.square().mean().sqrt()),
                   top1_agreement=float((logits.argmax(-1) == reference.argmax(-1)).double().mean()))


def benchmark_shape(name: str) -> dict:
    """The architecture's config.json dict from benchmarks/shapes.py, cut to LAYERS layers."""
    spec = importlib.util.spec_from_file_location("benchmark_shapes", SHAPES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {**module.SHAPES[name], "num_hidden_layers": LAYERS}


def random_transformers_model(shape: dict, seed: int):
    """transformers' float32 model of `shape` on the GPU with weights spread like the tiny checkpoints'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {key: value for key, value in shape.items() if key not in ("model_type", "torch_dtype")}
    config = AutoConfig.for_model(shape["model_type"], **fields)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, device=DEVICE)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model.eval()


def transformers_logits(model, tokens: dict[str, list[int]]) -> torch.Tensor:
    """Each sequence whole (causal, so every position teacher-forced), rows of "a" then "b", float32."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([ids], device=DEVICE)).logits[0].float() for ids in tokens.values()])


def flare_logits(cfg, model, tokens: dict[str, list[int]]) -> torch.Tensor:
    """The same positions fed by SCHEDULE through a fresh paged cache of the model's dtype, rows of "a" then "b"."""
    total = sum(len(ids) for ids in tokens.values())
    runner = PagedRunner(cfg, model, page_size=16, num_pages=-(-total // 16) + 8,
                         dtype=model.lm_head.matrix.dtype, device=DEVICE)
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in tokens}
    fed = dict.fromkeys(tokens, 0)
    for step in SCHEDULE:
        logits = runner.step({name: tokens[name][fed[name]:fed[name] + count] for name, count in step.items()})
        for name, count in step.items():
            fed[name] += count
            rows[name].append(logits[name])
    assert fed == {name: len(ids) for name, ids in tokens.items()}
    return torch.cat([torch.cat(parts) for parts in rows.values()])


@pytest.fixture(scope="module", params=["llama-8b", "qwen3-8b"])
def gate(request):
    """(shape name, {variant: Deviation}, the largest float32 logit) for one architecture."""
    from flare.engine.attention import TorchReferenceBackend
    from flare.engine.attention_triton import TritonBackend
    from flare.engine.compile import compile_model
    from flare.engine.prompt_kernel import use_prompt_kernel
    from flare.kernels.flashinfer_prefill import KERNEL_NAME
    from flare.models import ModelConfig
    from flare.models.loader import load_model

    shape = benchmark_shape(request.param)
    theirs = random_transformers_model(shape, seed=0)
    generator = torch.Generator().manual_seed(1)
    tokens = {name: torch.randint(3, shape["vocab_size"], (sum(step.get(name, 0) for step in SCHEDULE),),
                                  generator=generator).tolist() for name in ("a", "b")}
    exact = transformers_logits(theirs, tokens)
    cfg = ModelConfig.from_hf_config(theirs.config.to_dict())
    ours, reference = (load_model(cfg, theirs.state_dict().items(), torch.bfloat16, DEVICE, backend)
                       for backend in (TritonBackend(), TorchReferenceBackend()))
    theirs.to(torch.bfloat16)
    deviations = {"transformers bf16": Deviation.of(transformers_logits(theirs, tokens), exact)}
    del theirs
    deviations["flare reference attention"] = Deviation.of(flare_logits(cfg, reference, tokens), exact)
    del reference
    deviations["flare eager"] = Deviation.of(flare_logits(cfg, ours, tokens), exact)
    compile_model(ours)
    deviations["flare compiled"] = Deviation.of(flare_logits(cfg, ours, tokens), exact)
    if use_prompt_kernel(ours, KERNEL_NAME, DEVICE, torch.bfloat16).kernel == KERNEL_NAME:   # Hopper + FlashInfer
        deviations["flare compiled, FlashInfer prompts"] = Deviation.of(flare_logits(cfg, ours, tokens), exact)
    scale = float(exact.abs().max())
    write_report(request.config.getoption("numerics_report"), request.param, deviations, scale, exact.shape[0])
    del ours, exact
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return request.param, deviations, scale


def write_report(path, shape: str, deviations: dict, scale: float, positions: int) -> None:
    """Add this shape's measurements to the JSON report at `path` (None: no report), and print them."""
    for variant, deviation in deviations.items():
        print(f"{shape} {variant:26} max {deviation.max_abs:.4f} rms {deviation.rms:.5f} "
              f"top-1 {deviation.top1_agreement:.4f} (largest logit {scale:.2f}, {positions} positions)")
    if path is None:
        return
    path = Path(path)
    report = json.loads(path.read_text()) if path.is_file() else {
        "gate": "teacher-forced logits against transformers float32", "layers": LAYERS,
        "tolerance": {"ratio": RATIO, "slack_of_largest_logit": SLACK, "top1_points": TOP1_POINTS},
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
        "shapes": {}}
    report["shapes"][shape] = {"largest_logit": scale, "positions": positions,
                               "deviations": {variant: asdict(d) for variant, d in deviations.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def assert_as_close(gate, variant: str, yardstick: str) -> None:
    shape, deviations, scale = gate
    if variant not in deviations:
        pytest.skip(f"{variant}: not measured here (FlashInfer's FA3 kernels need Hopper and FlashInfer)")
    ours, theirs = deviations[variant], deviations[yardstick]
    assert ours.max_abs <= RATIO * theirs.max_abs + SLACK * scale, (shape, ours, theirs)
    assert ours.rms <= RATIO * theirs.rms + SLACK * scale, (shape, ours, theirs)
    assert ours.top1_agreement >= theirs.top1_agreement - TOP1_POINTS, (shape, ours, theirs)


@pytest.mark.parametrize("variant", ["flare eager", "flare compiled", "flare compiled, FlashInfer prompts"])
def test_bf16_logits_are_as_close_to_float32_as_transformers_bf16(gate, variant):
    assert_as_close(gate, variant, "transformers bf16")


@pytest.mark.parametrize("variant", ["flare reference attention", "flare eager", "flare compiled",
                                     "flare compiled, FlashInfer prompts"])
def test_bf16_logits_are_as_close_to_float32_as_the_reference_attention(gate, variant):
    """The Triton kernels (and the compiled layers) lose nothing against float32 softmax in torch; the
    reference variant itself is held to transformers' bf16."""
    assert_as_close(gate, variant, "transformers bf16" if variant == "flare reference attention"
                    else "flare reference attention")
