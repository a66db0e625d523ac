"""Host work of one ``fp_recipes.Linear`` forward + backward on a CPU, per recipe and with quantization
off: aten ops dispatched, Python calls made, and wall time (the fastest of 15 timings of 50 steps: the
least disturbed by other load on a shared machine). On a CPU every cast is the pure-torch reference
(hundreds of small CPU kernels), so this measures the work a step issues, not GPU speed.

``--weights changing`` (default) bumps the weight's version after every step, as an optimizer step
does (every forward casts the weight); ``--weights fixed`` leaves it, as for the 2nd..nth micro-batch
of gradient accumulation, where the module reuses its cached quantized weight (docs/modules.md)::

    python benchmarks/host_linear_cpu.py [--weights changing|fixed] [--kernels reference|stub]
                                         [--m 16 --k 64 --n 64] [--json]

``--kernels stub`` measures what a GPU step's host runs instead: the FP8 and per-token casts go through
the CUDA op wrappers (``ops/cuda_fp8.py``: argument checks, output allocations, the launch call) with a
do-nothing extension in place of ``fp_recipes._C``, and the FP8 GEMMs through ``gemm/fp8.py``'s native
branch with a ``torch._scaled_mm`` that only allocates its output. No numbers are computed, so only the
host work of the library is timed (on a GPU each launch also costs a few microseconds of driver time).
The delayed-scaling update still runs its torch-op twin (on CUDA: one kernel launch). NVFP4 goes through
the wrappers of ``ops/cuda_nvfp4.py`` the same way, and its GEMMs through the host code of the Hopper
emulation's CUDA path (``gemm/nvfp4_emulated.py``: the unit-decode launch, a cuBLASLt BF16 GEMM that
only returns, the row-scale epilogue launch): rows ``nvfp4`` (the default recipe: 2-D weight tiles, RHT
and stochastic rounding) and ``nvfp4_rs46`` (the row-scaled + 4over6 "fast" configuration of
``benchmarks/bench_model.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling



def _nvfp4_rs46() -> NVFP4BlockScaling:
    """The row-scaled + 4over6 "fast" NVFP4 configuration (bench_model.py's "NVFP4 row-scaled+4over6 fast")."""
    return NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True,
                             disable_stochastic_rounding=True, nvfp4_4over6="all",
                             nvfp4_4over6_err_use_fast_math=True)


RECIPES = {"off": None, "delayed": DelayedScaling, "current": Float8CurrentScaling,
           "nvfp4": NVFP4BlockScaling, "nvfp4_rs46": _nvfp4_rs46, "per_token": PerTokenScaling}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class _StubExtension:
    """Stands in for ``fp_recipes._C``: every launcher accepts its arguments and does nothing."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        # kept on the instance (never invalidated: every launcher does the same nothing), so a later
        # access is a plain attribute read, as on the real extension module
        launcher = lambda *args, **kwargs: None  # noqa: E731
        setattr(self, name, launcher)
        return launcher


def install_stub_kernels() -> None:
    """Route CPU tensors through the CUDA op wrappers and the native FP8 GEMM branch (see module doc)."""
    from fp_recipes import _extension, ops
    from fp_recipes.gemm import fp8 as gemm_fp8
    from fp_recipes.ops import cuda_fp8

    _extension._ext, _extension._ext_loaded = _StubExtension(), True
    # the Python host path (the torch-linked one declines CPU tensors; it is measured on a GPU)
    _extension._fast, _extension._fast_loaded = None, True

    def require(op, **tensors):  # the wrapper's checks, less "is it on a CUDA device"
        device = None
        for name, t in tensors.items():
            device = t.device if device is None else device
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous")
        return device

    cuda_fp8._require_cuda = require
    cuda_fp8._call = lambda op, impl, *args: impl(*args)
    cuda_fp8._stream = lambda device: 0
    for name in ("fp8_amax", "fp8_quantize", "fp8_current_scaling_quantize", "fp8_dequantize",
                 "per_token_cast", "cast_back", "bias_grad"):
        setattr(ops, name, getattr(cuda_fp8, name))
    gemm_fp8.fp8_native_gemm_available = lambda *args: True

    def scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)

    torch._scaled_mm = scaled_mm
    _install_stub_nvfp4()


class _StubCublasLt:
    """Stands in for ``gemm/cublaslt.py`` in the NVFP4 emulation only: the BF16 GEMM "runs" (its output
    was allocated by the caller), so the FP8 GEMMs keep their own launcher."""

    @staticmethod
    def available() -> bool:
        return True

    @staticmethod
    def bf16_gemm_device_alpha(a, b, out, alpha_beta, *, bias=None) -> bool:
        return True


def _install_stub_nvfp4() -> None:
    """NVFP4 casts through ``ops/cuda_nvfp4.py`` and GEMMs through the CUDA emulation's host code."""
    from fp_recipes import ops
    from fp_recipes.gemm import nvfp4 as gemm_nvfp4, nvfp4_emulated
    from fp_recipes.ops import cuda_nvfp4

    cuda_nvfp4._require_cuda = lambda x, what: None  # the checks, less "is it on a CUDA device"
    cuda_nvfp4._stream_of = lambda device: 0
    cuda_nvfp4._AMAX_WS[(None, 0)] = torch.zeros((4,), dtype=torch.int32)  # a stream's amax workspace
    for name in ("nvfp4_amax", "nvfp4_row_amax", "nvfp4_quantize", "nvfp4_dequantize"):
        setattr(ops, name, getattr(cuda_nvfp4, name))
    nvfp4_emulated.cublaslt = _StubCublasLt
    cuda_emulation = nvfp4_emulated.emulated_cuda_eager  # what gemm_nvfp4_nvfp4 runs for CUDA operands

    def emulated(a, b, out_dtype, bias):  # CPU operands take the CUDA emulation's path, not the torch ops
        out = cuda_emulation(a, b, out_dtype, bias)
        if out is None:
            raise RuntimeError("host_linear_cpu: the CUDA emulation declined a stubbed NVFP4 GEMM")
        return out

    gemm_nvfp4.gemm_nvfp4_emulated = emulated


def count(step) -> dict:
    """aten ops and Python calls of one step (after a warm-up)."""
    for _ in range(5):
        step()
    counter = _CountOps()
    with counter:
        step()
    calls = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1
    sys.setprofile(profile)
    step()
    sys.setprofile(None)
    return {"aten_ops": counter.n, "python_calls": calls[0]}


#: the layer's ``weight_columnwise_copy``: "save" by default, the path of the common case with at least as many
#: tokens as outputs (the default 16 tokens and 64 outputs would make "auto" recast in the backward)
WEIGHT_COPY = "save"


def measure(name: str, m: int, k: int, n: int, changing: bool) -> dict:
    torch.manual_seed(0)
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    layer = fp_recipes.Linear(k, n)
    layer.weight_columnwise_copy = WEIGHT_COPY
    x = torch.randn(m, k, requires_grad=True)

    def step() -> None:
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
        y.backward(torch.ones_like(y))
        if changing:
            with torch.no_grad():
                layer.weight.add_(0.0)  # as an optimizer step: a new version of the weight

    out = count(step)
    best = float("inf")
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(50):
            step()
        best = min(best, (time.perf_counter() - t) / 50)
    return {**out, "us": round(best * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", choices=("changing", "fixed"), default="changing")
    p.add_argument("--kernels", choices=("reference", "stub"), default="reference")
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--weight-copy", choices=("save", "recast", "auto"), default="save",
                   help="the layer's weight_columnwise_copy (docs/modules.md)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    global WEIGHT_COPY
    WEIGHT_COPY = args.weight_copy
    torch.set_num_threads(1)
    names = list(RECIPES)
    if args.kernels == "stub":
        install_stub_kernels()
    out = {name: measure(name, args.m, args.k, args.n, args.weights == "changing") for name in names}
    if args.json:
        print(json.dumps(out))
        return
    print(f"Linear {args.m}x{args.k} @ {args.k}x{args.n}, forward + backward, weights {args.weights}, "
          f"{args.kernels} kernels, CPU")
    print(f"{'recipe':<11} {'aten ops':>9} {'py calls':>9} {'us':>9}")
    for name, r in out.items():
        print(f"{name:<11} {r['aten_ops']:>9} {r['python_calls']:>9} {r['us']:>9.1f}")


if __name__ == "__main__":
    main()
