"""The delayed-scaling scale update as one CUDA launch (csrc/delayed_update.cu, ops/cuda_delayed.py)
against its torch-op twin (amax_reduction.batched_update_scales with USE_UPDATE_KERNEL off) and against
Float8Quantizer.update_scale, bit for bit: every history slot and every scale, over batch sizes across
the launch chunk (224 quantizers), history lengths, both algos, margins, both FP8 formats and special
amaxes (0, -0.0, subnormal, huge, NaN, +-Inf, non-finite values in any slot: counted as 0, written back
as 0, and the quantizer flagged, so each path warns for the same quantizers). The last tests run on CPU."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fp_recipes
from fp_recipes import DelayedScaling, GroupedLinear, Linear, _extension
from fp_recipes.modules import amax_reduction
from fp_recipes.ops import backend, cuda_delayed
from fp_recipes.quantizers.float8 import Float8Quantizer, NonFiniteAmaxWarning
from fp_recipes.quantizers.roles import QuantizerRole, QuantizerSpec

cuda = pytest.mark.cuda
NAN_PAYLOAD = 0x7FC00123  # an old scale with an unusual NaN payload: kept bit for bit when not updated


def _histories(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, length) FP32 histories of random magnitudes with special rows, and (n,) old scales."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.randint(-44, 38, (n, 1), generator=g).float()
    h = (torch.rand(n, length, generator=g) * mag).float()
    tiny, huge = 1e-45, 3e38
    for i in range(n):
        kind = i % 13
        if kind == 0:
            h[i] = 0.0
        elif kind == 1:
            h[i, 0] = 0.0
        elif kind == 2:
            h[i] = 0.0
            h[i, 0] = tiny  # fmt_max / tiny overflows: +Inf -> FLT_MAX
        elif kind == 3:
            h[i, 0] = huge
        elif kind == 4:
            h[i, 0] = float("nan")
        elif kind == 5:
            h[i, 0] = float("inf")
        elif kind == 6:
            h[i] = -0.0
        elif kind == 7:
            h[i, length // 2] = float("nan")  # NaN in a non-first slot (slot 0 when length == 1)
        elif kind == 8:
            h[i] = 0.0
            h[i, ::2] = -0.0
        elif kind == 9:
            h[i, 0] = 448.0 / 3.3e38  # the scale lands next to FLT_MAX (margin 0) without overflowing
        elif kind == 10:
            h[i, -1] = float("inf")
        elif kind == 11:
            h[i, 0] = float("-inf")
        elif kind == 12:
            h[i, :3] = torch.tensor([float("inf"), float("nan"), float("-inf")])[:length]
    scales = (torch.rand(n, generator=g) * 100).float()
    scales.view(torch.int32)[::7] = NAN_PAYLOAD
    scales[1::11] = float("inf")
    return h, scales


def _quantizers(h: torch.Tensor, scales: torch.Tensor, algo: str, margin: int, fmt: str, device) -> list:
    spec = QuantizerSpec(role=QuantizerRole("linear", "activation", 0), fmt=fmt, scaling="delayed",
                         amax_history_len=h.shape[1], margin=margin, amax_compute_algo=algo)
    qs = []
    for i in range(h.shape[0]):
        q = Float8Quantizer(spec)
        q.bind_state(scales[i].to(device).clone(), h[i].to(device).clone())  # separate tensors each
        qs.append(q)
    return qs


def _bits(qs: list) -> tuple[torch.Tensor, torch.Tensor]:
    hist = torch.stack([q.amax_history for q in qs]).view(torch.int32).cpu()
    scale = torch.stack([q.scale.reshape(()) for q in qs]).view(torch.int32).cpu()
    return hist, scale


def _assert_same(a: list, b: list, what: str) -> None:
    ha, sa = _bits(a)
    hb, sb = _bits(b)
    bad = (sa != sb).nonzero().flatten().tolist()
    assert not bad, f"{what}: scales differ at {bad[:8]}: {sa[bad[:8]].tolist()} vs {sb[bad[:8]].tolist()}"
    bad = (ha != hb).any(1).nonzero().flatten().tolist()
    assert not bad, f"{what}: histories differ at quantizers {bad[:8]}"


@pytest.fixture
def kernel_counter(monkeypatch):
    """Counts the kernel-path calls (to be sure the path under test ran). The launches counted are the Python host
    path's: the torch-linked one (FP_RECIPES_TORCH_OPS) makes the same launches from C++, compared with this one
    in tests/test_cuda_fast_ops.py."""
    assert cuda_delayed.available(), backend.extension_error()
    monkeypatch.setattr(_extension, "_fast", None)
    monkeypatch.setattr(_extension, "_fast_loaded", True)
    calls = []
    real = cuda_delayed.DelayedUpdate.__call__

    def counting(self, *args):
        calls.append(self.count)
        return real(self, *args)

    monkeypatch.setattr(cuda_delayed.DelayedUpdate, "__call__", counting)
    return calls


@cuda
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])  # fmt_max 448, 57344
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 2, 16, 1024])
@pytest.mark.parametrize("n", [1, 3, 64, 65, 300])
def test_kernel_is_torch_ops_and_update_scale_bit_for_bit(n, length, algo, margin, fmt, kernel_counter,
                                                            monkeypatch):
    h, scales = _histories(n, length, seed=n * 7919 + length)
    h, scales = h.cuda(), scales.cuda()
    kern, ops, single = (_quantizers(h, scales, algo, margin, fmt, "cuda") for _ in range(3))
    g = torch.Generator().manual_seed(n + length)
    for step in range(3):  # the same (cached) pointer table step after step, the history rolling
        amax_reduction.batched_update_scales(kern)
        monkeypatch.setattr(amax_reduction, "USE_UPDATE_KERNEL", False)
        amax_reduction.batched_update_scales(ops)
        monkeypatch.setattr(amax_reduction, "USE_UPDATE_KERNEL", True)
        for q in single:
            q.update_scale()
        _assert_same(kern, ops, f"kernel vs torch ops, step {step}")
        _assert_same(kern, single, f"kernel vs update_scale, step {step}")
        new = torch.rand(n, generator=g) * 10.0 ** (step * 3 - 3)
        new[::5] = torch.tensor([0.0, float("nan"), float("inf"), 1e-40, 3e38])[step % 5]
        new[2::9] = float("-inf")
        for qs in (kern, ops, single):
            for q, v in zip(qs, new.cuda()):
                q.record_amax(v)
    assert kernel_counter == [n] * 3
    # the flags reach the host lazily on CUDA (no sync in the step): after a sync and one more update,
    # the same quantizers have warned on every path
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteAmaxWarning)
        amax_reduction.batched_update_scales(kern)
        monkeypatch.setattr(amax_reduction, "USE_UPDATE_KERNEL", False)
        amax_reduction.batched_update_scales(ops)
        for q in single:
            q.update_scale()
    warned = [[getattr(q, "nonfinite_warned", False) for q in qs] for qs in (kern, ops, single)]
    assert warned[0] == warned[1] == warned[2] and any(warned[0])


@cuda
def test_shared_state_falls_back_to_torch_ops(kernel_counter):
    """Two quantizers on one history/scale: the kernel would update it twice; the torch ops run."""
    h, scales = _histories(4, 8, seed=5)
    a = _quantizers(h, scales, "max", 0, "e4m3", "cuda")
    b = _quantizers(h, scales, "max", 0, "e4m3", "cuda")
    twin = Float8Quantizer(a[0].spec)
    twin.bind_state(a[0].scale, a[0].amax_history)
    amax_reduction.batched_update_scales(a + [twin])
    amax_reduction.batched_update_scales(b)
    _assert_same(a, b, "shared state")
    assert kernel_counter == [4]  # b only


def _step(model, x, splits, recipe):
    with fp_recipes.autocast(recipe=recipe):
        y = model["g"](model["a"](x), splits)
    y.float().square().sum().backward()
    return y


@cuda
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_step_on_cuda_same_state_as_torch_ops(algo, kernel_counter, monkeypatch):
    """Whole training steps of a delayed-scaling Linear + GroupedLinear (forward and backward updates):
    identical outputs, gradients and state buffers with the kernel and with the torch ops."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": Linear(64, 64), "g": GroupedLinear(3, 64, 32)}).cuda()
    twin = copy.deepcopy(model)
    recipe = DelayedScaling(amax_history_len=5, margin=1, amax_compute_algo=algo)
    xs = [torch.randn(24, 64, device="cuda") * 4.0 ** s for s in range(4)]
    splits = [8, 0, 16]
    outs = []
    for use_kernel, m in ((True, model), (False, twin)):
        monkeypatch.setattr(amax_reduction, "USE_UPDATE_KERNEL", use_kernel)
        outs.append([_step(m, x, splits, recipe) for x in xs])
    assert kernel_counter and len(kernel_counter) >= 2 * len(xs)  # forward and backward each step
    for ya, yb in zip(*outs):
        assert torch.equal(ya, yb)
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        if isinstance(a, torch.Tensor):  # bytes: NaN == NaN, -0.0 != +0.0
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


# ---- CPU -----------------------------------------------------------------------------------------

def test_cpu_batches_do_not_use_the_kernel(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the CUDA updater was used for CPU tensors")

    monkeypatch.setattr(cuda_delayed.DelayedUpdate, "build", boom)
    monkeypatch.setattr(cuda_delayed.DelayedUpdate, "__call__", boom)
    model = torch.nn.ModuleDict({"a": Linear(16, 16), "g": GroupedLinear(2, 16, 16)})
    x = torch.randn(8, 16, requires_grad=True)
    for _ in range(2):
        _step(model, x, [3, 5], DelayedScaling(amax_history_len=4))
    assert model["a"].quantizer_sets[0].activation.amax_history[-1].item() > 0


def test_pointer_table_refuses_what_the_kernel_cannot_take():
    h, s = [torch.zeros(4) for _ in range(2)], [torch.ones(()) for _ in range(2)]
    dev = torch.device("cpu")
    ok = cuda_delayed.DelayedUpdate.build(h, s, 4, dev)
    assert ok is not None and ok.table.tolist() == [t.data_ptr() for t in h + s] + [0]  # no flags
    flags = torch.zeros(2, dtype=torch.bool)
    with_flags = cuda_delayed.DelayedUpdate.build(h, s, 4, dev, flags)
    assert with_flags.table.tolist() == [t.data_ptr() for t in h + s] + [flags.data_ptr()]
    with pytest.raises(ValueError, match="flags must be a contiguous bool"):
        cuda_delayed.DelayedUpdate.build(h, s, 4, dev, torch.zeros(3, dtype=torch.bool))
    assert cuda_delayed.DelayedUpdate.build([h[0], h[0]], s, 4, dev) is None  # shared history
    assert cuda_delayed.DelayedUpdate.build(h, [s[0], s[0]], 4, dev) is None  # shared scale
    strided = torch.zeros(4, 2)[:, 0]
    assert cuda_delayed.DelayedUpdate.build([h[0], strided], s, 4, dev) is None
    assert cuda_delayed.DelayedUpdate.build([h[0], h[1].double()], s, 4, dev) is None


def test_binding_validates_before_launching():
    ext = backend.extension()
    if ext is None or not hasattr(ext, "delayed_update_scales"):
        pytest.skip("extension not built")
    ext.delayed_update_scales(0, 0, 1, 448.0, 0, True, 0)  # nothing to update: no launch
    with pytest.raises(ValueError, match="history length"):
        ext.delayed_update_scales(0, 0, 0, 448.0, 0, True, 0)
    with pytest.raises(ValueError, match="pointer table"):
        ext.delayed_update_scales(0, 3, 4, 448.0, 0, True, 0)
