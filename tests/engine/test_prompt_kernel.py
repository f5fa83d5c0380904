"""The prompt attention kernel: chosen at export where FlashInfer can run, followed (or refused, with the
reason) when serving."""

from __future__ import annotations

import pytest
import torch

from flare.engine.attention_triton import TritonBackend
from flare.engine.prompt_kernel import TRITON, choose_prompt_kernel, use_prompt_kernel
from flare.kernels.flashinfer_prefill import KERNEL_NAME


class TinyAttention(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.backend = backend

        class Cfg:
            num_attention_heads, num_key_value_heads, head_dim = 4, 2, 16
        self.cfg = Cfg


def test_off_a_hopper_gpu_the_triton_kernel_is_chosen_and_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    choice = choose_prompt_kernel("cpu", torch.float32, "auto", 32, 8, 128)
    assert choice == choose_prompt_kernel("cpu", torch.bfloat16, "auto", 32, 8, 128)
    assert choice.kernel == TRITON and choice.detail == "Triton prompt attention (FlashInfer's FA3 kernels need a CUDA GPU)"
    assert choose_prompt_kernel("cuda", torch.bfloat16, "fp8", 32, 8, 128).detail == \
        "Triton prompt attention (the FP8 KV cache)"


def test_a_plan_of_triton_changes_nothing():
    model = torch.nn.Sequential(TinyAttention(TritonBackend()))
    assert use_prompt_kernel(model, TRITON, "cpu", torch.float32).kernel == TRITON
    assert model[0].backend.prompt_kernel is None


def test_a_flashinfer_plan_that_cannot_run_here_falls_back_and_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    model = torch.nn.Sequential(TinyAttention(TritonBackend()), TinyAttention(TritonBackend()))
    choice = use_prompt_kernel(model, KERNEL_NAME, "cpu", torch.bfloat16)
    assert choice.kernel == TRITON
    assert choice.detail == ("the package chose FlashInfer's FA3 prompt attention, but FlashInfer's FA3 kernels "
                             "need a CUDA GPU: Triton prompt attention")
    assert all(layer.backend.prompt_kernel is None for layer in model)


def test_an_unknown_kernel_is_refused_by_name():
    model = torch.nn.Sequential(TinyAttention(TritonBackend()))
    with pytest.raises(ValueError, match="unknown prompt attention kernel 'fa9'"):
        use_prompt_kernel(model, "fa9", "cpu", torch.float32)


def test_a_flashinfer_that_fails_to_load_leaves_the_triton_kernel(monkeypatch):
    """Start-up survives a broken FlashInfer: the note names the failure, prompts stay on our kernel."""
    from flare.kernels.flashinfer_prefill import FlashInferPrefill

    def broken(self):
        raise OSError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr("flare.kernels.flashinfer_prefill.unavailable_reason", lambda device, dtype: None)
    monkeypatch.setattr(FlashInferPrefill, "_new_wrapper", broken)
    model = torch.nn.Sequential(TinyAttention(TritonBackend()))
    choice = use_prompt_kernel(model, KERNEL_NAME, "cpu", torch.float32)
    assert choice.kernel == TRITON and model[0].backend.prompt_kernel is None
    assert choice.detail == ("the package chose FlashInfer's FA3 prompt attention, but it failed to load (OSError: "
                             "libcudart.so.13: cannot open shared object file): Triton prompt attention")
