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
as having a side effect (graph passes would drop it as dead code).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["define_op", "register_fake"]

_LIB = torch.library.Library("fp_recipes", "FRAGMENT")


def define_op(name: str, impl: Callable, *, mutates_args: Sequence[str] = (), side_effect: bool = False):
    """Define ``torch.ops.fp_recipes.<name>`` running ``impl``; returns its overload (call it directly)."""
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=tuple(mutates_args)))
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
