"""The ``torch.ops.fp_recipes`` operators: what code traced by torch.compile calls instead of Python.

Each op is defined from its implementation's type hints (``torch.library.infer_schema``), registered
for every backend (``CompositeExplicitAutograd``: the implementation checks the device itself and
says what is wrong) and given a fake implementation for tracing. This is ``torch.library.custom_op``
without its per-call Python layers (an autograd wrapper and aliasing checks): a do-nothing op took
8.3 us per call that way against 2.6 us defined here (2-core CPU; an H100 machine's host profile showed
tens of microseconds per call), paid by a compiled step for every cast and GEMM. No op here has an autograd formula: they run inside autograd Functions'
forward and backward, where nothing differentiates through them.

An op that mutates an argument returns a tuple of fresh tensors (never a list: functionalization
takes no list output from an op that mutates), and one with no output that must still run is marked
as having a side effect (graph passes would drop it as dead code). Ops whose work is on the host when they run
(those side effects; a stochastic-rounding counter read) are tagged ``cudagraph_unsafe``, so that
``torch.compile(mode="reduce-overhead")`` runs them between its CUDA graphs instead of replaying a capture.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["define_op", "register_fake"]

_LIB = torch.library.Library("fp_recipes", "FRAGMENT")


#: The tag that keeps an op out of torch.compile's CUDA graphs (``mode="reduce-overhead"``: with Inductor's graph
#: partition the op runs between captured partitions, every call), or None on a torch without it.
CUDAGRAPH_UNSAFE = getattr(torch._C.Tag, "cudagraph_unsafe", None)


def define_op(name: str, impl: Callable, *, mutates_args: Sequence[str] = (), side_effect: bool = False,
              cudagraph_unsafe: bool = False):
    """Define ``torch.ops.fp_recipes.<name>`` running ``impl``; returns its overload (call it directly).
    ``cudagraph_unsafe``: the op reads host state when it runs (a value a CUDA-graph replay would repeat). An op
    with a ``side_effect`` is one too: its effect is Python state, which a replay would not touch."""
    unsafe = (cudagraph_unsafe or side_effect) and CUDAGRAPH_UNSAFE is not None
    tags = (CUDAGRAPH_UNSAFE,) if unsafe else ()
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=tuple(mutates_args)), tags=tags)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    op = getattr(torch.ops.fp_recipes, name).default
    if side_effect:
        from torch.fx.node import has_side_effect

        has_side_effect(op)
    return op


def register_fake(op) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` computes ``op``'s output shapes and dtypes for tracing (fake tensors)."""
    def wrap(fn: Callable) -> Callable:
        torch.library.register_fake(op, fn, lib=_LIB)
        return fn

    return wrap
