"""Kernel tests run the real Triton kernels: compiled on a CUDA GPU, in Triton's interpreter elsewhere.

The interpreter must be chosen before triton is first imported, so it is switched on here, when this
directory is collected.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """The device the Triton kernels run on: cuda, or cpu through the interpreter."""
    if HAS_CUDA:
        return "cuda"
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.fail("triton was imported before tests/kernels/conftest.py could switch on its "
                    "interpreter (TRITON_INTERPRET=1); run these tests with TRITON_INTERPRET=1")
    return "cpu"
