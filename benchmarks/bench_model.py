"""Model-level training step: a stack of transformer-like blocks, BF16 against the quantized recipes.

Each block: LayerNorm + QKV (``LayerNormLinear``), causal attention (torch SDPA, BF16), proj (``Linear``),
LayerNorm + FC1, GELU, FC2, two residuals; the ``llama_*`` sizes use Llama-style blocks instead (RMSNorm,
grouped-query attention, no biases, SwiGLU: ``LlamaBlock``). One step = forward + backward of the whole stack, eager
(torch.compile for the "BF16 torch.compile", "FP8 ... torch.compile" and torchao rows). Per row: the step time (CUDA events
around many back-to-back steps, so host and GPU overlap as in training; the median of 5 such windows), the host time to enqueue one
step (the host clock around one step after a synchronisation), the peak memory of a step (for a CUDA-graph row: what
the capture and the replays reserved, since a replay allocates nothing), and the
ratio BF16-eager time / row time (>= 1 is faster than BF16).

    python benchmarks/bench_model.py --size small|full [--json out.json]
    python benchmarks/bench_model.py --linear          # one Linear 4096^3: GPU time, launches, host time

``--linear`` profiles one Linear (M = K = N = 4096, no bias) fwd+bwd per recipe with torch.profiler:
the GPU time is the sum of the step's kernel and memset durations, the launch count counts kernels and
memsets (as issue 13's BF16 figure of 8 does); the FP8 rows run under torch.compile too (unless
``--no-compiled``), and "speed-up" is BF16's step time over the row's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import warnings
import statistics
import sys
import time
from unittest import mock
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp_recipes  # noqa: E402
from fp_recipes import (DelayedScaling, Float8CurrentScaling, LayerNormLinear, Linear,  # noqa: E402
                        NVFP4BlockScaling)
from fp_recipes.modules.base import QuantizedModule  # noqa: E402
from fp_recipes.ops.activations import GATED  # noqa: E402

SWIGLU = GATED["swiglu"]  # (torch's ops, the same in the BF16 and the quantized blocks)

SIZES = {
    # name: (hidden, ffn, tokens, layers)
    "h2048_t8192": (2048, 8192, 8192, 4),
    "h4096_t4096": (4096, 14336, 4096, 4),
    "h4096_t8192": (4096, 14336, 8192, 4),
    # Llama-style blocks (LlamaBlock): Llama-3.2-1B's and Llama-3-8B's widths; ffn is SwiGLU's inner size
    "llama_h2048_t8192": (2048, 8192, 8192, 4),
    "llama_h4096_t4096": (4096, 14336, 4096, 4),
}
SIZE_SETS = {"small": ["h2048_t8192"], "full": list(SIZES)}
SEQ = 2048
HEAD_DIM = 128
#: query heads per key/value head in LlamaBlock (Llama 3: 32 query heads share 8 key/value heads)
GQA_GROUP = 4


def recipes() -> Dict[str, Any]:
    return {
        "FP8 delayed": DelayedScaling(),
        "FP8 current": Float8CurrentScaling(),
        "NVFP4 default": NVFP4BlockScaling(),
        "NVFP4 row-scaled+4over6 fast": NVFP4BlockScaling(
            row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True,
            disable_stochastic_rounding=True, nvfp4_4over6="all", nvfp4_4over6_err_use_fast_math=True),
    }


class Block(torch.nn.Module):
    """Pre-norm transformer block; ``quantized`` picks fp_recipes modules (else plain torch ones)."""

    def __init__(self, hidden: int, ffn: int, quantized: bool, device, dtype=torch.bfloat16,
                 fused_activation: bool = False) -> None:
        super().__init__()
        kw = dict(device=device)
        self.fused_activation = fused_activation and quantized
        self.heads = hidden // HEAD_DIM
        if quantized:
            self.qkv = LayerNormLinear(hidden, 3 * hidden, bias=True, params_dtype=dtype, **kw)
            self.proj = Linear(hidden, hidden, bias=True, params_dtype=dtype, **kw)
            self.fc1 = LayerNormLinear(hidden, ffn, bias=True, params_dtype=dtype, **kw)
            self.fc2 = Linear(ffn, hidden, bias=True, params_dtype=dtype, **kw)
            self.norm1 = self.norm2 = None
        else:
            self.norm1 = torch.nn.LayerNorm(hidden, dtype=dtype, **kw)
            self.qkv = torch.nn.Linear(hidden, 3 * hidden, dtype=dtype, **kw)
            self.proj = torch.nn.Linear(hidden, hidden, dtype=dtype, **kw)
            self.norm2 = torch.nn.LayerNorm(hidden, dtype=dtype, **kw)
            self.fc1 = torch.nn.Linear(hidden, ffn, dtype=dtype, **kw)
            self.fc2 = torch.nn.Linear(ffn, hidden, dtype=dtype, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        h = self.qkv(x if self.norm1 is None else self.norm1(x))
        q, k, v = h.view(tokens // SEQ, SEQ, 3, self.heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(tokens, hidden))
        h = self.fc1(x if self.norm2 is None else self.norm2(x))
        if self.fused_activation:  # (fp_recipes.LayerNormMLP's FC2)
            return x + self.fc2.forward_activation(h, "gelu")
        return x + self.fc2(F.gelu(h, approximate="tanh"))


class LlamaBlock(torch.nn.Module):
    """Pre-norm Llama-style block: RMSNorm, fused QKV with grouped-query attention (``GQA_GROUP`` query heads per
    key/value head), no biases, SwiGLU MLP (FC1 makes gate and up, FC2 is the down projection). ``quantized``: the
    norms are ``LayerNormLinear``'s RMSNorm and the SwiGLU runs between FC1 and FC2, as ``LayerNormMLP(activation=
    "swiglu")`` does; the BF16 block is ``torch.nn.RMSNorm`` and ``torch.nn.Linear`` with the same ops between."""

    def __init__(self, hidden: int, ffn: int, quantized: bool, device, dtype=torch.bfloat16) -> None:
        super().__init__()
        kw = dict(device=device)
        self.heads = hidden // HEAD_DIM
        self.kv_heads = max(1, self.heads // GQA_GROUP)
        qkv_out = (self.heads + 2 * self.kv_heads) * HEAD_DIM
        if quantized:
            self.qkv = LayerNormLinear(hidden, qkv_out, bias=False, normalization="RMSNorm", params_dtype=dtype, **kw)
            self.proj = Linear(hidden, hidden, bias=False, params_dtype=dtype, **kw)
            self.fc1 = LayerNormLinear(hidden, 2 * ffn, bias=False, normalization="RMSNorm", params_dtype=dtype, **kw)
            self.fc2 = Linear(ffn, hidden, bias=False, params_dtype=dtype, **kw)
            self.norm1 = self.norm2 = None
        else:
            self.norm1 = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=dtype, **kw)
            self.qkv = torch.nn.Linear(hidden, qkv_out, bias=False, dtype=dtype, **kw)
            self.proj = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype, **kw)
            self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=dtype, **kw)
            self.fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype, **kw)
            self.fc2 = torch.nn.Linear(ffn, hidden, bias=False, dtype=dtype, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        b = tokens // SEQ
        h = self.qkv(x if self.norm1 is None else self.norm1(x))
        q, k, v = h.view(b, SEQ, self.heads + 2 * self.kv_heads, HEAD_DIM).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(tokens, hidden))
        h = self.fc1(x if self.norm2 is None else self.norm2(x))
        return x + self.fc2(SWIGLU(h))


#: whether the fp_recipes modules may reuse a quantized weight while it is unchanged (docs/modules.md, weight
#: cache). The benchmark runs no optimizer, so its weights never change: with the cache, current scaling would
#: skip every weight cast after the first step (delayed scaling misses anyway: its scales change at every
#: autocast exit) and torch.compile (no cache) would not. Off by default: a training step with one micro-batch
#: per optimizer step casts every weight (--weights fixed: the cache, as gradient accumulation's later
#: micro-batches see it). Session 23 and earlier measured with the cache on.
CACHE_WEIGHTS = [False]
#: every fp_recipes module's ``weight_columnwise_copy`` (docs/modules.md): "auto" (the default) recasts the
#: columnwise copy of a weight with more outputs than tokens in the backward; --weight-copy save/recast for an A/B
WEIGHT_COPY = ["auto"]
#: --fused-activation: the FP8 delayed rows (eager and compiled) again with FC2 taking FC1's output and applying the
#: GELU in its input's cast (``Linear.forward_activation``, what ``LayerNormMLP`` does; FP8 delayed scaling on CUDA
#: never writes the GELU's output; current scaling's quantizer takes the composition by default, quantizers/
#: float8.py), measured in the same process as the default rows
FUSED_ACTIVATION = [False]
#: --compiled-nvfp4: the NVFP4 rows under torch.compile(fullgraph=True) too (traced, each emulated GEMM and each
#: stochastically rounded cast is one op running the eager kernels); [1], --nvfp4-traced-ops-ab: each again with the
#: torch-ops forms Inductor compiles instead (the emulation's table decode, the pure-torch SR twin), in one process
COMPILED_NVFP4 = [False, False]
#: --fast-accum-ab: every FP8 row (model and --linear, eager and compiled) again with the recipe's
#: fast_accumulation="all" (dgrad and wgrad in cuBLASLt's fast accumulation too; the default is fprop only, as
#: TransformerEngine and torchao), in the same process
FAST_ACCUM_AB = [False]


def fast_accum_variants(name: str, recipe: Any) -> List[Tuple[str, Any]]:
    """(label, recipe) of the row itself and, with --fast-accum-ab for an FP8 recipe, its all-fast twin."""
    out = [(name, recipe)]
    if FAST_ACCUM_AB[0] and name.startswith("FP8"):
        out.append((f"{name} [fast accum all]", recipe.replace(fast_accumulation="all")))
    return out


@contextlib.contextmanager
def nvfp4_traced_torch_ops() -> Iterator[None]:
    """Traced NVFP4 GEMMs and SR casts as torch ops for Inductor (``nvfp4_emulated.TRACED_AS_OP`` and
    ``NVFP4Quantizer.traced_sr_as_op`` off), the form before session 37."""
    from fp_recipes.gemm import nvfp4_emulated
    from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer

    with mock.patch.object(nvfp4_emulated, "TRACED_AS_OP", False), \
            mock.patch.object(NVFP4Quantizer, "traced_sr_as_op", False):
        yield


def build(hidden: int, ffn: int, layers: int, quantized: bool, device: str = "cuda",
          fused_activation: bool = False, llama: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if llama:
        blocks = [LlamaBlock(hidden, ffn, quantized, device) for _ in range(layers)]
    else:
        blocks = [Block(hidden, ffn, quantized, device, fused_activation=fused_activation) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks)
    for m in model.modules():
        if isinstance(m, QuantizedModule):
            m.cache_quantized_weights = CACHE_WEIGHTS[0]
            m.weight_columnwise_copy = WEIGHT_COPY[0]
    return model


def make_step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: Any = None,
              run: Optional[Callable] = None) -> Callable[[], None]:
    fwd = model if run is None else run  # (a compiled Linear has no truth value: len() raises)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        x.grad = None
        if recipe is None:
            y = fwd(x)
        else:
            with fp_recipes.autocast(recipe=recipe):
                y = fwd(x)
        y.backward(dy)

    return step


def measure(step: Callable[[], None], warmup: int, iters: int) -> Dict[str, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    hosts = []
    for _ in range(max(5, iters)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    reserved_before = getattr(step, "reserved_before", None)
    if reserved_before is not None:
        # a CUDA-graph replay allocates nothing (its memory is the graph pool, reserved at capture, before the
        # baseline above): report what the capture and the steps reserved instead, an upper bound of their use
        peak = torch.cuda.memory_reserved() - reserved_before
    # the median of 5 timed windows: one window moved host-bound rows by up to 2.5 ms between calls
    windows = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        windows.append(start.elapsed_time(end) / iters)
    return {"step_ms": statistics.median(windows), "step_ms_windows": windows,
            "host_ms": statistics.median(hosts), "peak_mib": peak / 2**20,
            "peak_kind": "allocated" if reserved_before is None else "reserved (graph pool)"}


def make_graphed_step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: Any) -> Callable[[], None]:
    """The model captured by fp_recipes.make_graphed_callables (forward + backward graphs, the delayed
    scaling updates inside them); the step replays them (no autocast: the graph carries the recipe)."""
    torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved()
    sample = x.detach().clone().requires_grad_(x.requires_grad)
    fwd = fp_recipes.make_graphed_callables(model, (sample,), recipe=recipe)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        x.grad = None
        fwd(x).backward(dy)

    step.reserved_before = reserved_before  # (measure: the graph's memory is reserved, not allocated per step)
    return step


def nvfp4_row_scratch(nbytes: int) -> ContextManager:
    """Row-scaled NVFP4 GEMMs chunked so that each chunk's FP32 scratch is at most ``nbytes`` (``nvfp4_emulated.py``)."""
    from fp_recipes.gemm import nvfp4_emulated

    return mock.patch.object(nvfp4_emulated, "ROW_CHUNK_SCRATCH_BYTES", nbytes)


def gemm_workspace(nbytes: int) -> ContextManager:
    """fp_recipes' dense GEMMs planned with an ``nbytes`` cuBLASLt workspace (the GEMM paths read it at every call)."""
    from fp_recipes.gemm import cublaslt

    return mock.patch.object(cublaslt, "WORKSPACE_BYTES", nbytes)


def nvfp4_module_units(mode: str) -> ContextManager:
    """A Linear's NVFP4 activation and gradient casts write ``mode``'s unit operands (NVFP4Quantizer.module_gemm_units;
    the modules' quantizers are made at their first forward)."""
    from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer

    return mock.patch.object(NVFP4Quantizer, "module_gemm_units", mode)


def model_rows(size: str, warmup: int, iters: int, compiled: bool = True,
               graphed: bool = False, python_host: bool = False,
               only: Optional[List[str]] = None, workspace_ab: Optional[int] = None,
               row_scratch_ab: Optional[int] = None, units_ab: Optional[str] = None) -> List[Dict[str, Any]]:
    hidden, ffn, tokens, layers = SIZES[size]
    llama = size.startswith("llama_")  # (LlamaBlock; its MLP is gated: no fused-GELU rows)
    build_model = functools.partial(build, llama=llama)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    rows = []

    def add(label: str, make: Callable[[], Callable[[], None]], host_path: Any = None) -> None:
        if only and label != "BF16 eager" and not any(o.lower() in label.lower() for o in only):
            return  # (--rows: BF16 eager, the baseline, always runs)
        if "compile" in label:  # each compiled row starts from an empty Dynamo cache: the models of earlier rows and
            torch._dynamo.reset()  # sizes share code objects, and their entries would count toward the recompile limit
        try:
            with host_path() if host_path is not None else contextlib.nullcontext():
                r = measure(make(), warmup, iters)
        except Exception as exc:  # report, do not hide
            print(f"  {label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            r = {"error": f"{type(exc).__name__}: {exc}"}
        r.update(size=size, row=label)
        rows.append(r)
        if "step_ms" in r:
            print(f"  {label:32s} step {r['step_ms']:8.2f} ms  host {r['host_ms']:8.2f} ms  "
                  f"peak {r['peak_mib']:9.0f} MiB", flush=True)
        gc.collect()
        torch.cuda.empty_cache()

    add("BF16 eager", lambda: make_step(build_model(hidden, ffn, layers, False), x, dy))
    if compiled:
        add("BF16 torch.compile", lambda: (lambda m: make_step(m, x, dy, run=torch.compile(m)))(
            build_model(hidden, ffn, layers, False)))
    for name, recipe in recipes().items():
        for label, variant in fast_accum_variants(name, recipe):
            add(label, lambda recipe=variant: make_step(build_model(hidden, ffn, layers, True), x, dy, recipe))
        if python_host and name in ("FP8 delayed", "FP8 current"):
            from _host_path import python_host_path

            add(f"{name} (Python host path)", lambda recipe=recipe: make_step(
                build_model(hidden, ffn, layers, True), x, dy, recipe), host_path=python_host_path)
        if workspace_ab is not None:
            add(f"{name} [GEMM workspace {workspace_ab}]", lambda recipe=recipe: make_step(
                build_model(hidden, ffn, layers, True), x, dy, recipe), host_path=lambda: gemm_workspace(workspace_ab))
        if units_ab is not None and name.startswith("NVFP4"):
            add(f"{name} [units {units_ab}]", lambda recipe=recipe: make_step(
                build_model(hidden, ffn, layers, True), x, dy, recipe), host_path=lambda: nvfp4_module_units(units_ab))
        if row_scratch_ab is not None and "row-scaled" in name:
            add(f"{name} [row scratch {row_scratch_ab >> 20} MiB]", lambda recipe=recipe: make_step(
                build_model(hidden, ffn, layers, True), x, dy, recipe), host_path=lambda: nvfp4_row_scratch(row_scratch_ab))
        if FUSED_ACTIVATION[0] and not llama and name == "FP8 delayed":  # (current scaling takes the composition: float8.py)
            for label, variant in fast_accum_variants(name, recipe):
                add(f"{label} (fused GELU)", lambda recipe=variant: make_step(
                    build_model(hidden, ffn, layers, True, fused_activation=True), x, dy, recipe))
    from fp_recipes.modules.base import COMPILE_MIN_TORCH, compile_supported
    if compiled and not compile_supported():
        print(f"  fp_recipes torch.compile rows skipped: they need torch >= {'.'.join(map(str, COMPILE_MIN_TORCH))} "
              f"(this is {torch.__version__})")
    elif compiled:
        # fp_recipes modules under torch.compile (fullgraph: a graph break would be an error, not a
        # silent slowdown); autocast outside the compiled model, as a training loop writes it.
        for name, recipe in recipes().items():
            if name.startswith("FP8") or (COMPILED_NVFP4[0] and name.startswith("NVFP4")):
                for label, variant in fast_accum_variants(name, recipe):
                    add(label.replace(name, f"{name} torch.compile"), lambda recipe=variant: (lambda m: make_step(
                        m, x, dy, recipe, run=torch.compile(m, fullgraph=True)))(build_model(hidden, ffn, layers, True)))
                if COMPILED_NVFP4[1] and name.startswith("NVFP4"):
                    add(f"{name} torch.compile [traced torch ops]", lambda recipe=recipe: (lambda m: make_step(
                        m, x, dy, recipe, run=torch.compile(m, fullgraph=True)))(build_model(hidden, ffn, layers, True)),
                        host_path=nvfp4_traced_torch_ops)
                if FUSED_ACTIVATION[0] and not llama and name == "FP8 delayed":
                    for label, variant in fast_accum_variants(name, recipe):
                        add(f"{label.replace(name, f'{name} torch.compile')} (fused GELU)",
                            lambda recipe=variant: (lambda m: make_step(
                                m, x, dy, recipe, run=torch.compile(m, fullgraph=True)))(
                                build_model(hidden, ffn, layers, True, fused_activation=True)))
                if python_host:
                    from _host_path import python_host_path

                    add(f"{name} torch.compile (Python host path)", lambda recipe=recipe: (lambda m: make_step(
                        m, x, dy, recipe, run=torch.compile(m, fullgraph=True)))(build_model(hidden, ffn, layers, True)),
                        host_path=python_host_path)
    if graphed:  # every recipe (NVFP4's stochastic rounding reads its counter on the device: graphs.py)
        for name, recipe in recipes().items():
            add(f"{name} CUDA graph", lambda recipe=recipe: make_graphed_step(
                build_model(hidden, ffn, layers, True), x, dy, recipe))
    try:
        if not compiled:
            raise ImportError("skipped (--no-compiled)")
        with warnings.catch_warnings():  # torchao's own deprecation notices on import are noise in a table
            warnings.simplefilter("ignore")
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def ao():
            m = build_model(hidden, ffn, layers, False)
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
            return make_step(m, x, dy, run=torch.compile(m))

        add("torchao Float8 (compiled)", ao)
    except ImportError as exc:
        print(f"  torchao unavailable: {exc}")
    base = next((r["step_ms"] for r in rows if r["row"] == "BF16 eager" and "step_ms" in r), None)
    for r in rows:
        if base and "step_ms" in r:
            r["x_bf16"] = base / r["step_ms"]
    return rows


def linear_profile(m: int = 4096, k: int = 4096, n: int = 4096, compiled: bool = True,
                   python_host: bool = False, units_ab: Optional[str] = None,
                   graphed: bool = False) -> List[Dict[str, Any]]:
    """One Linear fwd+bwd per recipe: step time, GPU time and launches (profiler), host time; with
    ``compiled``, the FP8 rows under torch.compile(fullgraph=True) too (autocast outside); ``python_host``: each
    FP8 row again with the Python host path (eager casts and GEMMs, the traced ops' implementations), in this
    process for an A/B; ``graphed``: every recipe again captured by make_graphed_callables (host: one replay)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    def quantized() -> Linear:
        layer = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        layer.cache_quantized_weights = CACHE_WEIGHTS[0]
        layer.weight_columnwise_copy = WEIGHT_COPY[0]
        return layer

    python_path = None
    if python_host:
        from _host_path import python_host_path as python_path
    cases = [("BF16", torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), None, False, None)]
    for name, recipe in recipes().items():
        cases += [(label, quantized(), variant, False, None) for label, variant in fast_accum_variants(name, recipe)]
        if python_path is not None and name.startswith("FP8"):
            cases.append((name + " (Python host path)", quantized(), recipe, False, python_path))
        if units_ab is not None and name.startswith("NVFP4"):
            cases.append((f"{name} [units {units_ab}]", quantized(), recipe, False,
                          lambda: nvfp4_module_units(units_ab)))
    if compiled:
        for name, recipe in recipes().items():
            if name.startswith("FP8"):
                cases += [(label.replace(name, f"{name} torch.compile"), quantized(), variant, True, None)
                          for label, variant in fast_accum_variants(name, recipe)]
                if python_path is not None:
                    cases.append((name + " torch.compile (Python host path)", quantized(), recipe, True, python_path))
    if graphed:
        for name, recipe in recipes().items():
            cases.append((name + " CUDA graph", quantized(), recipe, "graph", None))
    rows = []
    for name, mod, recipe, compile_it, host_path in cases:
        if compile_it is True:
            torch._dynamo.reset()  # (as model_rows: a fresh Dynamo cache per compiled row)
        if compile_it == "graph":
            step = make_graphed_step(mod, x, dy, recipe)
        else:
            step = make_step(mod, x, dy, recipe, run=torch.compile(mod, fullgraph=True) if compile_it else None)
        steps = 5
        with host_path() if host_path is not None else contextlib.nullcontext():
            r = measure(step, 5, 50)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.device_time for e in kernels) / steps
        per_kernel: Dict[str, List[float]] = {}
        for e in kernels:
            per_kernel.setdefault(e.name[:90], []).append(e.device_time)
        breakdown = sorted(((nm, sum(v) / steps, len(v) / steps) for nm, v in per_kernel.items()),
                           key=lambda t: -t[1])
        r.update(row=name, gpu_ms=gpu_us / 1e3, launches=len(kernels) / steps,
                 kernels=[{"name": nm, "us_per_step": us, "launches_per_step": c} for nm, us, c in breakdown])
        for nm, us, c in breakdown:
            print(f"      {us:8.1f} us  x{c:3.0f}  {nm}")
        rows.append(r)
        print(f"  {name:32s} step {r['step_ms']:6.3f} ms  GPU {r['gpu_ms']:6.3f} ms  launches {r['launches']:5.1f}  "
              f"host {r['host_ms']:6.3f} ms", flush=True)
    base, base_step = rows[0]["gpu_ms"], rows[0]["step_ms"]
    for r in rows:
        r["gpu_x_bf16"] = r["gpu_ms"] / base
        r["step_speedup"] = base_step / r["step_ms"]  # BF16's step time / the row's
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZE_SETS), default="small")
    p.add_argument("--sizes", default=None, help="comma-separated size names (overrides --size): "
                   + ", ".join(SIZES))
    p.add_argument("--no-compiled", action="store_true", help="skip the torch.compile rows (compile time)")
    p.add_argument("--graphed", action="store_true", help="add the fp_recipes.make_graphed_callables rows "
                   "(every recipe captured as a CUDA graph; --linear too)")
    p.add_argument("--linear", action="store_true", help="the one-Linear 4096^3 profile instead")
    p.add_argument("--fast-accum-ab", action="store_true", help="add each FP8 row (model and --linear, eager and "
                   "compiled) again with fast_accumulation='all' (dgrad and wgrad in cuBLASLt's fast accumulation "
                   "too; the default is fprop only), in the same process")
    p.add_argument("--nvfp4-gemm-units", default=None, choices=["none", "rowwise", "auto", "all"],
                   help="which BF16 unit GEMM operands every NVFP4 quantize kernel writes (NVFP4Quantizer.gemm_units: "
                   "default_gemm_units and module_gemm_units)")
    p.add_argument("--nvfp4-units-ab", default=None, choices=["none", "rowwise", "auto", "all"],
                   help="add each NVFP4 row (model and --linear) again with the modules' activation and gradient casts "
                   "writing these unit operands (NVFP4Quantizer.module_gemm_units), in the same process")
    p.add_argument("--fp8-compile-visible-amax", action="store_true",
                   help="compiled current-scaling rows compute the amax in the graph, where Inductor can fuse it "
                   "into the producing kernel (Float8CurrentScalingQuantizer.compile_visible_amax)")
    p.add_argument("--weights", choices=("changing", "fixed"), default="changing",
                   help="changing (default): every step casts every weight, as with an optimizer step per "
                   "micro-batch; fixed: the modules' weight cache reuses unchanged weights' casts")
    p.add_argument("--weight-copy", choices=("auto", "save", "recast"), default="auto",
                   help="every module's weight_columnwise_copy (docs/modules.md; default auto)")
    p.add_argument("--fused-activation", action="store_true",
                   help="add the FP8 delayed rows (eager and compiled) again with the MLP's GELU applied in FC2's input "
                   "cast (LayerNormMLP's path) instead of torch's GELU before FC2, in the same process")
    p.add_argument("--compiled-nvfp4", action="store_true",
                   help="model rows: the NVFP4 recipes under torch.compile(fullgraph=True) too (unless --no-compiled)")
    p.add_argument("--nvfp4-traced-ops-ab", action="store_true",
                   help="with --compiled-nvfp4: each compiled NVFP4 row again with its GEMMs and SR casts as the torch "
                   "ops Inductor compiles (the emulation, the pure-torch twin) instead of one op each, in one process")
    p.add_argument("--python-host-rows", action="store_true",
                   help="add each FP8 row (eager and compiled; --linear too) again with the Python host path "
                   "(FP_RECIPES_TORCH_OPS=off: Python casts and GEMMs, the traced ops' Python implementations), "
                   "measured in the same process as the default rows")
    p.add_argument("--rows", default=None, type=lambda v: [r for r in v.split(",") if r.strip()],
                   help="model rows to run: comma-separated, case-insensitive parts of row labels (e.g. "
                   "'delayed torch.compile,NVFP4 default'); BF16 eager always runs. Saves device time")
    p.add_argument("--gemm-workspace", type=int, default=None, metavar="BYTES",
                   help="cuBLASLt workspace of fp_recipes' dense GEMMs (gemm/cublaslt.py WORKSPACE_BYTES, default 0: "
                   "algorithms without split-K / stream-K workspace, so no memset launch per GEMM); e.g. 33554432 "
                   "(torch's 32 MiB) for an A/B of the launches and GPU time")
    p.add_argument("--gemm-workspace-ab", type=int, default=None, metavar="BYTES",
                   help="model rows: each eager quantized row again with a BYTES GEMM workspace, in the same process")
    p.add_argument("--nvfp4-row-scratch-ab", type=int, default=None, metavar="BYTES",
                   help="add each row-scaled NVFP4 row again with its GEMMs chunked to at most BYTES of FP32 scratch "
                        "(nvfp4_emulated.ROW_CHUNK_SCRATCH_BYTES), in the same process")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    CACHE_WEIGHTS[0] = args.weights == "fixed"
    WEIGHT_COPY[0] = args.weight_copy
    FUSED_ACTIVATION[0] = args.fused_activation
    COMPILED_NVFP4[:] = [args.compiled_nvfp4, args.nvfp4_traced_ops_ab]
    FAST_ACCUM_AB[0] = args.fast_accum_ab
    if args.fp8_compile_visible_amax:
        from fp_recipes.quantizers.float8 import Float8CurrentScalingQuantizer

        Float8CurrentScalingQuantizer.compile_visible_amax = True
    if args.nvfp4_gemm_units is not None:
        from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer

        NVFP4Quantizer.default_gemm_units = NVFP4Quantizer.module_gemm_units = args.nvfp4_gemm_units
    if args.gemm_workspace is not None:
        from fp_recipes.gemm import cublaslt

        cublaslt.WORKSPACE_BYTES = args.gemm_workspace  # (the GEMM paths read it at every call)
    if not torch.cuda.is_available():
        print("bench_model: needs a CUDA GPU")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    result: Dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "weights": args.weights, "weight_copy": args.weight_copy,
                              "fused_activation": args.fused_activation,
                              "fp8_compile_visible_amax": args.fp8_compile_visible_amax,
                              "fast_accum_ab": args.fast_accum_ab, "gemm_workspace": args.gemm_workspace, "nvfp4_gemm_units": args.nvfp4_gemm_units,
                              "nvfp4_units_ab": args.nvfp4_units_ab}
    if args.linear:
        print("one Linear 4096x4096x4096, fwd+bwd, no bias")
        rows = result["linear"] = linear_profile(compiled=not args.no_compiled, python_host=args.python_host_rows,
                                                 units_ab=args.nvfp4_units_ab, graphed=args.graphed)
        print(f"\n{'row':34s} {'GPU ms':>8s} {'x BF16':>7s} {'launches':>8s} {'host ms':>8s} {'step ms':>8s} "
              f"{'speed-up':>8s}")
        for r in rows:
            print(f"{r['row']:34s} {r['gpu_ms']:8.3f} {r['gpu_x_bf16']:7.2f} {r['launches']:8.1f} "
                  f"{r['host_ms']:8.3f} {r['step_ms']:8.3f} {r['step_speedup']:8.2f}")
    else:
        names = args.sizes.split(",") if args.sizes else SIZE_SETS[args.size]
        rows = []
        for size in names:
            hidden, ffn, tokens, layers = SIZES[size]
            print(f"{size}: hidden {hidden}, ffn {ffn}, tokens {tokens}, {layers} blocks", flush=True)
            rows += model_rows(size, args.warmup, args.iters, compiled=not args.no_compiled, only=args.rows,
                               graphed=args.graphed, python_host=args.python_host_rows,
                               workspace_ab=args.gemm_workspace_ab, row_scratch_ab=args.nvfp4_row_scratch_ab,
                               units_ab=args.nvfp4_units_ab)
        result["model"] = rows
        print(f"\n{'size':12s} {'row':32s} {'step ms':>8s} {'x BF16':>7s} {'host ms':>8s} {'peak MiB':>9s}")
        for r in rows:
            if "step_ms" not in r:
                print(f"{r['size']:12s} {r['row']:32s} {'failed':>8s}")
                continue
            print(f"{r['size']:12s} {r['row']:32s} {r['step_ms']:8.2f} {r.get('x_bf16', 0):7.2f} "
                  f"{r['host_ms']:8.2f} {r['peak_mib']:9.0f}{'' if r['peak_kind'] == 'allocated' else ' (reserved)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
