"""fp_recipes.gemm.cublaslt: many FP8 GEMMs in one host call through cuBLASLt.

On CUDA its results are compared with ``torch._scaled_mm`` (the same library and math: FP32
accumulation, per-tensor FP32 scales) and with an FP32 emulation; without a GPU only the availability
report and the pure-Python pieces are checked."""

from __future__ import annotations

import pytest
import torch

from fp_recipes import _extension
from fp_recipes.gemm import cublaslt

DEFAULT_GROUPED_WORKSPACE = cublaslt.GROUPED_WORKSPACE_BYTES
TORCH_WORKSPACE_BYTES = 32 * 2**20  # what torch gives cuBLASLt on Hopper


@pytest.fixture(autouse=True)
def _torch_workspace(monkeypatch):
    """Grouped GEMMs planned with torch's workspace size, so their bits can be compared with
    torch._scaled_mm's (test_matches_scaled_mm also runs the grouped default, without a workspace)."""
    monkeypatch.setattr(cublaslt, "GROUPED_WORKSPACE_BYTES", TORCH_WORKSPACE_BYTES)

cuda = pytest.mark.cuda


def test_status_is_a_sentence_everywhere():
    text = cublaslt.status()
    assert isinstance(text, str) and text
    if not torch.cuda.is_available():
        assert not cublaslt.available()
        assert text.startswith("unavailable: ")


def test_loaded_library_path_names_cublaslt():
    assert "libcublasLt.so" in cublaslt._loaded_cublaslt_path()


def _fp8(shape, dtype, seed, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype).to(device)


def _scale(v, device="cuda"):
    return torch.tensor(v, dtype=torch.float32, device=device)


def _emulated(a, sa, b, sb, bias, out_dtype):
    out = (a.float() @ b.float().t()) * (sa * sb)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("b_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("workspace", ["torch's", "grouped default"])
def test_matches_scaled_mm(out_dtype, fast_accum, b_dtype, workspace, monkeypatch):
    """With torch's workspace size the plans pick torch._scaled_mm's algorithms: the same bits. The
    grouped default plans without a workspace (faster for expert GEMMs): other algorithms, so the bits
    may differ; the FP32-emulation bound below holds for both."""
    assert cublaslt.available(), cublaslt.status()
    if workspace == "grouped default":
        monkeypatch.setattr(cublaslt, "GROUPED_WORKSPACE_BYTES", DEFAULT_GROUPED_WORKSPACE)
    shapes = [(64, 128, 256), (1, 16, 16), (333, 48, 96), (2048, 2048, 7168), (7, 4096, 32)]
    a = [_fp8((m, k), torch.float8_e4m3fn, i) for i, (m, n, k) in enumerate(shapes)]
    b = [_fp8((n, k), b_dtype, 100 + i) for i, (m, n, k) in enumerate(shapes)]
    sa = [_scale(0.5 + i) for i in range(len(shapes))]
    sb = [_scale(0.25 * (i + 1)) for i in range(len(shapes))]
    out = [torch.empty(m, n, dtype=out_dtype, device="cuda") for m, n, k in shapes]
    skipped = cublaslt.fp8_gemms(a, sa, b, sb, out, fast_accum=fast_accum)
    assert skipped == []
    for i in range(len(shapes)):
        ref = torch._scaled_mm(a[i], b[i].t(), scale_a=sa[i], scale_b=sb[i], out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
        emu = _emulated(a[i], sa[i], b[i], sb[i], None, out_dtype)
        # Same library, same problem: the same algorithm is expected, hence the same bits. Should the
        # heuristics ever differ, the FP32-emulation check below still bounds the result.
        if workspace == "torch's":
            assert torch.equal(out[i], ref), f"GEMM {i} {shapes[i]}: bits differ from torch._scaled_mm"
        # Sanity bound against the FP32 emulation. Hopper's FP8 tensor cores add products into an
        # accumulator of reduced precision (about 2^-13 relative to the running sum); without fast
        # accumulation partial sums are promoted to FP32 every few K-blocks, with it the whole K runs in
        # that accumulator. Bound: one output ulp + 2^-12 (promoted) or 2^-7 (fast) of sum |a||b|.
        rel = 2.0 ** -7 if fast_accum else 2.0 ** -12
        tol = torch.finfo(out_dtype).eps * emu.float().abs() + rel * (a[i].float().abs() @
                                                                     b[i].float().abs().t()) * sa[i] * sb[i]
        assert torch.all((out[i].float() - emu.float()).abs() <= tol + 1e-30), i


@cuda
def test_bias_epilogue_and_views_into_one_output():
    m_splits, n, k = [128, 0, 64, 256], 96, 160
    x = _fp8((sum(m_splits), k), torch.float8_e4m3fn, 1)
    w = [_fp8((n, k), torch.float8_e4m3fn, 10 + g) for g in range(len(m_splits))]
    bias = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in m_splits]
    s = [_scale(1.0 / (g + 1)) for g in range(len(m_splits))]
    y = torch.full((sum(m_splits), n), float("nan"), dtype=torch.bfloat16, device="cuda")
    xs, ys = list(x.split(m_splits)), list(y.split(m_splits))
    live = [g for g, m in enumerate(m_splits) if m]
    skipped = cublaslt.fp8_gemms([xs[g] for g in live], [s[g] for g in live], [w[g] for g in live],
                                [s[g] for g in live], [ys[g] for g in live], bias=[bias[g] for g in live])
    assert skipped == []
    for g in live:
        ref = torch._scaled_mm(xs[g], w[g].t(), scale_a=s[g], scale_b=s[g], bias=bias[g], out_dtype=torch.bfloat16)
        assert torch.equal(ys[g], ref), g


@cuda
def test_shapes_cublaslt_cannot_take_are_returned_not_run():
    # K = 24 (not a multiple of 16), N = 40 (not a multiple of 16), K = 0: skipped, output untouched.
    a = [_fp8((32, 24), torch.float8_e4m3fn, 1), _fp8((32, 64), torch.float8_e4m3fn, 2),
         _fp8((32, 0), torch.float8_e4m3fn, 3), _fp8((32, 64), torch.float8_e4m3fn, 4)]
    b = [_fp8((32, 24), torch.float8_e4m3fn, 5), _fp8((40, 64), torch.float8_e4m3fn, 6),
         _fp8((32, 0), torch.float8_e4m3fn, 7), _fp8((32, 64), torch.float8_e4m3fn, 8)]
    s = [_scale(1.0) for _ in a]
    out = [torch.full((32, bi.shape[0]), 7.0, dtype=torch.bfloat16, device="cuda") for bi in b]
    skipped = cublaslt.fp8_gemms(a, s, b, s, out)
    assert skipped == [0, 1, 2]
    for i in skipped:
        assert torch.all(out[i] == 7.0)
    ref = torch._scaled_mm(a[3], b[3].t(), scale_a=s[3], scale_b=s[3], out_dtype=torch.bfloat16)
    assert torch.equal(out[3], ref)


@cuda
def test_scales_are_read_on_the_device_at_run_time():
    # The plan caches descriptors per shape; the scale pointers must be the ones of this call.
    a = _fp8((64, 64), torch.float8_e4m3fn, 1)
    b = _fp8((64, 64), torch.float8_e4m3fn, 2)
    outs = []
    for v in (1.0, 2.0, 0.5):
        out = torch.empty(64, 64, dtype=torch.float32, device="cuda")
        assert cublaslt.fp8_gemms([a], [_scale(v)], [b], [_scale(1.0)], [out]) == []
        outs.append(out)
    assert torch.equal(outs[1], outs[0] * 2) and torch.equal(outs[2], outs[0] * 0.5)


@cuda
def test_scales_inside_a_packed_vector_are_returned_not_run():
    a = [_fp8((64, 64), torch.float8_e4m3fn, 1), _fp8((64, 64), torch.float8_e4m3fn, 2)]
    b = [_fp8((32, 64), torch.float8_e4m3fn, 3), _fp8((32, 64), torch.float8_e4m3fn, 4)]
    packed = torch.tensor([0.5, 2.0], device="cuda")
    out = [torch.empty(64, 32, dtype=torch.bfloat16, device="cuda") for _ in a]
    assert cublaslt.fp8_gemms(a, list(packed.unbind(0)), b, list(packed.unbind(0)), out) == [1]
    own = [v.clone() for v in packed.unbind(0)]  # separate allocations: aligned
    assert cublaslt.fp8_gemms(a, own, b, own, out) == []
    for i in range(2):
        ref = torch._scaled_mm(a[i], b[i].t(), scale_a=own[i], scale_b=own[i], out_dtype=torch.bfloat16)
        assert torch.equal(out[i], ref)


def test_gemms_run_with_their_device_current(monkeypatch):
    """cuBLASLt launches on the current device: a list for cuda:1 issued while cuda:0 is current must
    switch to cuda:1 for the call (and back). Checked without a GPU: torch.cuda's device functions, the
    workspace and the extension are replaced by recorders."""
    state = {"current": 0}
    calls = []

    class _Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.prev, state["current"] = state["current"], self.index

        def __exit__(self, *exc):
            state["current"] = self.prev

    class _Ext:
        def lt_fp8_gemms(self, *args):
            calls.append((state["current"], args[-2], args[-1]))
            return []

    class _Ws:
        def data_ptr(self):
            return 256

        def numel(self):
            return 0

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", _Guard)
    monkeypatch.setattr(_extension, "current_stream", lambda device: 1000 + device.index)
    monkeypatch.setattr(cublaslt, "_workspace", lambda device, stream, nbytes=None: _Ws())
    monkeypatch.setattr(_extension, "extension", lambda: _Ext())
    args = ([16], [16], [16], [16], [16], [16], [16], [16], torch.float8_e4m3fn, torch.float8_e4m3fn,
            torch.bfloat16)
    cublaslt.fp8_gemms_ptr(*args, torch.device("cuda", 1))
    cublaslt.fp8_gemms_ptr(*args, torch.device("cuda", 0))
    cublaslt.fp8_gemms_ptr(*args, torch.device("cuda"))
    assert calls == [(1, 1, 1001), (0, 0, 1000), (0, 0, 1000)]
    assert state["current"] == 0


def test_workspaces_are_per_stream_and_bounded(monkeypatch):
    monkeypatch.setattr(cublaslt, "_workspaces", {})
    monkeypatch.setattr(cublaslt, "WORKSPACE_BYTES", 64)
    dev = torch.device("cpu", 0)  # the cache logic only; on CUDA the same code allocates device memory
    first = cublaslt._workspace(dev, 1)
    assert cublaslt._workspace(dev, 1) is first and first.numel() == 64
    for stream in range(2, 2 + 2 * cublaslt._MAX_WORKSPACES):
        cublaslt._workspace(dev, stream)
    assert len(cublaslt._workspaces) == cublaslt._MAX_WORKSPACES
    assert cublaslt._workspace(dev, 1) is not first  # the oldest was dropped, a new one made


@cuda
@pytest.mark.parametrize("offset", [16, 48, 112])
def test_operands_at_16_byte_offsets_run_in_cublaslt_and_match_scaled_mm(offset):
    """An expert's operands inside a grouped buffer are only as aligned as its offset. The plan must ask
    cuBLASLt for an algorithm that takes that alignment (it assumes 256 bytes otherwise): the GEMM runs
    in cuBLASLt (not returned to the caller) and equals torch._scaled_mm on aligned copies."""
    m, n, k = 48, 32, 64
    buf_a = _fp8((offset + m * k,), torch.float8_e4m3fn, 1)
    buf_b = _fp8((offset + n * k,), torch.float8_e4m3fn, 2)
    a = buf_a[offset:].view(m, k)
    b = buf_b[offset:].view(n, k)
    assert a.data_ptr() % 256 != 0 and b.data_ptr() % 256 != 0
    s = _scale(0.5)
    out_buf = torch.empty(offset + m * n, dtype=torch.bfloat16, device="cuda")
    out = out_buf[offset // 2:offset // 2 + m * n].view(m, n)  # the output at a 16-byte offset too
    assert cublaslt.fp8_gemms([a], [s], [b], [s], [out]) == []
    ref = torch._scaled_mm(a.clone(), b.clone().t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16)
    assert torch.equal(out, ref)


def test_grouped_gemms_are_planned_without_a_workspace_by_default(monkeypatch):
    """The grouped default (GROUPED_WORKSPACE_BYTES = 0) passes no workspace and allocates none; a size
    set on purpose passes that workspace. Checked without a GPU: the extension records its arguments."""
    calls, made = [], []

    class _Ext:
        def lt_fp8_gemms(self, *args):
            calls.append(args[-4:-2])  # (workspace address, workspace bytes)
            return []

    class _Ws:
        def data_ptr(self):
            return 4096

        def numel(self):
            return 32

    def workspace(device, stream, nbytes=None):
        made.append(nbytes)
        return _Ws()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_extension, "current_stream", lambda device: 7)
    monkeypatch.setattr(cublaslt, "_workspace", workspace)
    monkeypatch.setattr(_extension, "extension", lambda: _Ext())
    args = ([16], [16], [16], [16], [16], [16], [16], [16], torch.float8_e4m3fn, torch.float8_e4m3fn,
            torch.bfloat16, torch.device("cuda", 0))
    assert DEFAULT_GROUPED_WORKSPACE == 0
    monkeypatch.setattr(cublaslt, "GROUPED_WORKSPACE_BYTES", DEFAULT_GROUPED_WORKSPACE)
    cublaslt.fp8_gemms_ptr(*args)
    assert calls == [(0, 0)] and made == []
    monkeypatch.setattr(cublaslt, "GROUPED_WORKSPACE_BYTES", 32)
    cublaslt.fp8_gemms_ptr(*args)
    assert calls[1] == (4096, 32) and made == [32]


@cuda
@pytest.mark.parametrize("recipe_name", ["current", "nvfp4"])
def test_linear_step_issues_no_memset(recipe_name):
    """The dense GEMMs are planned without a cuBLASLt workspace (WORKSPACE_BYTES = 0): with torch's 32 MiB, cuBLAS
    issued one ``Memset (Device)`` per GEMM of a Linear 4096^3 fwd+bwd on an H200 (benchmarks/RESULTS.md session 34),
    and current scaling's casts and NVFP4's amaxes reduce through the memset-free per-stream workspace, so the step
    has no memset at all (the shape of bench_model.py --linear)."""
    import fp_recipes

    assert cublaslt.WORKSPACE_BYTES == 0
    recipe = fp_recipes.Float8CurrentScaling() if recipe_name == "current" else fp_recipes.NVFP4BlockScaling()
    layer = fp_recipes.Linear(4096, 4096, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        with fp_recipes.autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)

    step()  # the first step makes the per-stream workspaces
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("nvjet" in n or "gemm" in n.lower() for n in names), names  # the GEMMs were profiled
    assert not any("memset" in n.lower() for n in names), sorted(set(names))
