"""Triton kernels, each with a private `_kernel`, a public launcher that checks shapes and strides, and a
torch reference beside it.

On a machine without CUDA the kernels run in Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton is first imported; the kernel tests do that. Under the interpreter
test at fp32/fp16 only: a bf16 `tl.dot` gives wrong results there.
"""
