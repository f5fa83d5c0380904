"""The built-in `demo` model: a tiny Llama trained locally, on first use, from Python's own documentation.

`ensure_demo_checkpoint(directory)` returns a Hugging Face checkpoint directory (built once, then
reused). Importing this package does not import torch.
"""

from flare.demo.build import ensure_demo_checkpoint, is_complete_build
from flare.demo.spec import BUILDER_VERSION, DemoSpec

__all__ = ["BUILDER_VERSION", "DemoSpec", "ensure_demo_checkpoint", "is_complete_build"]
