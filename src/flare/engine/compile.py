"""torch.compile for the model's forward: what gets compiled, with which settings.

Compiled: each decoder layer, around its attention kernel. Inductor fuses the small element-wise work
between the matrix products (RMSNorm in float32, the residual adds, the rotary embedding, SiLU times
up) into a few Triton kernels, while the matrix products stay cuBLAS calls (Inductor's default for
matmuls). A decode step at batch 1 is otherwise ~40 launches per layer, most of them tiny.

Not compiled: the attention backend (it launches our own Triton kernels and reads host-side metadata;
it runs between the compiled pieces of each layer), the embedding and the LM head (one kernel each).

The token dimension is dynamic, so one compilation serves every decode graph size and every prefill
length; the layers share their code, so all of them reuse one compilation.
"""

from __future__ import annotations

import torch

SETTINGS = {"dynamic": True, "fullgraph": False}


def compile_model(model) -> None:
    """Compile `model`'s decoder layers in place (a Llama-layout CausalLM); idempotent."""
    if getattr(model, "flare_compiled", False):
        return
    for layer in model.model.layers:
        backend = layer.self_attn.backend
        if not getattr(backend, "flare_outside_compile", False):
            # Attention runs eagerly between the compiled pieces (an instance attribute shadows the method).
            backend.forward = torch.compiler.disable(backend.forward)
            backend.flare_outside_compile = True
        layer.compile(**SETTINGS)
    model.flare_compiled = True
