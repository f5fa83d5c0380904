"""A Triton kernel may read a module-level value only when it is a `tl.constexpr(...)` instance: the GPU
compiler refuses any other global (NameError at compile time), while the interpreter the CPU tests run
under accepts it. This check catches that on the CPU, for every kernel Flare ships."""

import importlib
import pkgutil
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.jit import KernelInterface      # jitted kernels, interpreted ones too

import flare.kernels


def _jit_functions():
    for info in pkgutil.iter_modules(flare.kernels.__path__):
        module = importlib.import_module(f"flare.kernels.{info.name}")
        for value in vars(module).values():
            if not isinstance(value, KernelInterface):
                continue
            fn = value.fn
            while not isinstance(fn, types.FunctionType):          # autotune / heuristics wrappers
                fn = fn.fn
            if fn.__module__ == module.__name__:
                yield module, fn


def _bad_globals(fn: types.FunctionType) -> list[str]:
    code, scope = fn.__code__, fn.__globals__
    names = set(code.co_names)
    for const in code.co_consts:             # nested code objects (comprehensions, lambdas)
        if isinstance(const, types.CodeType):
            names |= set(const.co_names)
    bad = []
    for name in sorted(names):
        if name not in scope:
            continue
        value = scope[name]
        if isinstance(value, (bool, int, float, str, tuple, list, dict)) and not isinstance(value, tl.constexpr):
            bad.append(f"{name} = {value!r}")
    return bad


KERNELS = sorted({(module.__name__, fn.__name__): fn for module, fn in _jit_functions()}.items())


def test_every_kernel_module_was_found():
    modules = {module for (module, _), _ in KERNELS}
    assert {"flare.kernels.sampling", "flare.kernels.decode_attention", "flare.kernels.flash_prefill"} <= modules


@pytest.mark.parametrize("name,fn", KERNELS, ids=[f"{m.rsplit('.', 1)[1]}.{n}" for (m, n), _ in KERNELS])
def test_kernels_read_only_constexpr_globals(name, fn):
    assert _bad_globals(fn) == [], (f"{name[0]}.{name[1]} reads module globals the GPU compiler refuses; "
                                    f"define them as NAME = tl.constexpr(value)")
