"""Tiny FP8 checkpoints in the layouts real ones ship, made from a dense checkpoint, for CPU tests.

Written here, independently of `flare.models` (which reads them):
  * `write_block_fp8` - `quant_method: "fp8"` with `weight_block_size` [128, 128], as Qwen/Qwen3-8B-FP8 and
    DeepSeek-V3 publish: each decoder projection's `weight` as F8_E4M3 and `weight_scale_inv`
    [ceil(N/128), ceil(K/128)] (BF16 like Qwen's, or F32 like DeepSeek's); every other tensor BF16.
  * `write_compressed_tensors_fp8` - `quant_method: "compressed-tensors"`, format `float-quantized`, as
    RedHatAI's FP8 Llama checkpoints (llm-compressor): `weight` F8_E4M3 and `weight_scale` per output
    channel [N, 1] ("FP8_DYNAMIC": dynamic per-token activations) or per tensor [1] with a static
    `input_scale` [1] ("FP8"); `ignore: ["lm_head"]`.
  * `write_dequantized` - the reference: the same checkpoint with every FP8 weight multiplied back to
    float32 and no quantization_config, so a dense model computes what the FP8 one stands for.
Weights are quantized as those tools do: each block's (channel's, tensor's) absolute maximum maps to 448.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

E4M3_MAX = 448.0
# The decoder projections, and DeepSeek-V3's (MLA's, the experts' and the shared experts'; not the router's).
PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.((q|k|v|o)_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|"
                        r"kv_b_proj)|mlp\.((experts\.\d+|shared_experts)\.)?(gate|up|down)_proj)\.weight$")
ASSETS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json",
          "special_tokens_map.json")


def write_block_fp8(source: Path, directory: Path, scale_dtype: str = "bfloat16", ignore: tuple[str, ...] = (),
                    block: tuple[int, int] = (128, 128)) -> Path:
    """The Qwen3-FP8 / DeepSeek layout; `ignore` lists projections (module names) kept in BF16
    (`modules_to_not_convert`)."""
    import torch

    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    if ignore:
        config["modules_to_not_convert"] = list(ignore)

    def quantize(name, weight):
        q, scale = _quantize_blocks(weight, block)
        return {name: q, name + "_scale_inv": scale.to(getattr(torch, scale_dtype))}

    return _write(source, directory, config, quantize, skip=lambda name: any(name.startswith(i + ".") for i in ignore))


def write_compressed_tensors_fp8(source: Path, directory: Path, strategy: str = "channel",
                                 scale_dtype: str = "bfloat16") -> Path:
    """RedHatAI's layouts: "channel" is FP8_DYNAMIC (Meta-Llama-3.1-8B-Instruct-FP8-dynamic), "tensor" is
    FP8 with static input scales (Meta-Llama-3.1-8B-Instruct-FP8)."""
    import torch

    if strategy not in ("channel", "tensor"):
        raise ValueError(f"strategy {strategy!r}: channel or tensor")
    static = strategy == "tensor"
    config = {
        "config_groups": {"group_0": {
            "input_activations": _args("tensor" if static else "token", dynamic=not static),
            "output_activations": None, "targets": ["Linear"], "weights": _args(strategy, dynamic=False)}},
        "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed"}

    def quantize(name, weight):
        amax = weight.abs().amax(dim=1, keepdim=True) if strategy == "channel" else weight.abs().amax().reshape(1)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q = (weight / (scale if strategy == "channel" else scale[0])).clamp(-E4M3_MAX, E4M3_MAX)
        tensors = {name: q.to(torch.float8_e4m3fn), name[: -len("weight")] + "weight_scale": scale.to(getattr(torch, scale_dtype))}
        if static:                                  # a calibrated activation scale, as llm-compressor stores it
            tensors[name[: -len("weight")] + "input_scale"] = torch.tensor([0.05], dtype=getattr(torch, scale_dtype))
        return tensors

    return _write(source, directory, config, quantize, skip=lambda name: False)


def write_bf16(source: Path, directory: Path) -> Path:
    """`source` with every tensor in BF16: the checkpoint an FP8 one of the same weights was made from."""
    config = json.loads((Path(source) / "config.json").read_text()) | {"torch_dtype": "bfloat16"}
    return _save(source, directory, config, _tensors(source, lambda name, tensor: {name: tensor}))


def write_dequantized(fp8_checkpoint: Path, directory: Path) -> Path:
    """The FP8 checkpoint's weights multiplied back to float32, as a dense checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(fp8_checkpoint) / "model.safetensors"))
    config = json.loads((Path(fp8_checkpoint) / "config.json").read_text())
    quantization = config.pop("quantization_config")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale_inv", "weight_scale", "input_scale")):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            suffix = "weight_scale_inv" if quantization["quant_method"] == "fp8" else "weight_scale"
            scale = tensors[name[: -len("weight")] + suffix].float()
            out[name] = _dequantize(tensor, scale, quantization.get("weight_block_size"))
        else:
            out[name] = tensor.float()
    return _save(fp8_checkpoint, directory, config, out)


# ---- the formats' arithmetic, written out once here ----


def _quantize_blocks(weight, block):
    import torch

    rows, columns = weight.shape
    block_rows, block_columns = block
    q = torch.empty(rows, columns, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // block_rows), -(-columns // block_columns))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block_rows:(i + 1) * block_rows, j * block_columns:(j + 1) * block_columns].float()
            amax = tile.abs().max()
            scale[i, j] = amax / E4M3_MAX if amax > 0 else 1.0
            q[i * block_rows:(i + 1) * block_rows, j * block_columns:(j + 1) * block_columns] = \
                (tile / scale[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _dequantize(q, scale, block):
    out = q.float()
    if block is None:                               # per channel [N, 1] or per tensor [1]
        return out * (scale if scale.dim() == 2 else scale.reshape(()))
    block_rows, block_columns = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block_rows:(i + 1) * block_rows, j * block_columns:(j + 1) * block_columns] *= scale[i, j]
    return out


def _args(strategy: str, dynamic: bool) -> dict:
    """A compressed-tensors QuantizationArgs as it appears in config.json."""
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}, "strategy": strategy,
            "symmetric": True, "type": "float"}


def _write(source, directory, quantization_config, quantize, skip) -> Path:
    """Every tensor of `source` in BF16, then decoder projections through `quantize` (unless `skip`)."""
    config = json.loads((Path(source) / "config.json").read_text())
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = "bfloat16"

    def convert(name, tensor):
        return quantize(name, tensor.float()) if PROJECTION.match(name) and not skip(name) else {name: tensor}

    return _save(source, directory, config, _tensors(source, convert))


def _tensors(source, convert) -> dict:
    """`convert(name, bf16 tensor)` of every tensor in `source`'s safetensors files, merged."""
    import torch
    from safetensors import safe_open

    out = {}
    for file in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                out.update(convert(name, handle.get_tensor(name).to(torch.bfloat16)))
    return out


def _save(source, directory, config, tensors) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in ASSETS:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, directory / name)
    return directory
