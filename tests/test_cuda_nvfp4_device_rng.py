"""Stochastic rounding with the Philox seed and counter in device memory (``rng_state``): the kernels read the pair
when they run, so a CUDA graph replays each cast with the counter of that replay (make_graphed_callables).

Bytes, not tolerances: every launch form with ``rng_state`` against the same launch with the pair as ints
(resolved C++ launch, resolved Python launch, the general path with an amax override, the fused bias gradient),
over odd shapes, zeros and special values; then a quantizer in device mode against one with host ints, eagerly
and replayed from a captured graph.
"""

from __future__ import annotations

import pytest
import torch

from fp_recipes import _extension
from fp_recipes.ops import cuda_nvfp4 as K
from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer
from fp_recipes.quantizers.roles import QuantizerRole, QuantizerSpec

pytestmark = pytest.mark.cuda

SHAPES = [(16, 16), (112, 80), (64, 1040), (1024, 1024), (2048, 512)]
KEYS = [(0, 0), (2**63 + 12345, 2**40 + 7), (2**64 - 1, 2**64 - 2)]
# (rowwise, columnwise, block_2d, rht): the SR launch forms (rowwise kernel, tile kernels 1-D, RHT, 2-D)
FORMS = {"row": (True, False, False, False), "row_col": (True, True, False, False),
         "row_rhtcol": (True, True, False, True), "col_rht": (False, True, False, True),
         "2d": (True, True, True, False)}


def _plan(rowwise: bool, columnwise: bool, block_2d: bool, rht: bool) -> K.QuantizePlan:
    return K.QuantizePlan(rowwise=rowwise, columnwise=columnwise, block_2d=block_2d, row_scaled=False,
                          four_over_six=False, e4m3_max=448, err_mode="MAE", err_fast_math=False, rht=rht,
                          stochastic_rounding=True)


def _bits64(v: int) -> int:
    return v - 2**64 if v >= 2**63 else v


def _state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([_bits64(seed), _bits64(offset)], dtype=torch.int64, device="cuda")


def _input(shape, kind: str) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(31)
    x = torch.randn(*shape, device="cuda", generator=g)
    if kind == "zeros":
        x.zero_()
    elif kind == "special":
        flat = x.view(-1)
        flat[::7] = 0.0
        flat[3::97] = 3.0e4
        flat[5::211] = -1.0e-30
    return x.bfloat16()


def _same(a, b, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    va = a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.uint8)
    vb = b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.uint8)
    assert torch.equal(va, vb), f"{what}: {(va != vb).sum().item()} entries differ"


@pytest.mark.parametrize("launch", ["cpp", "python"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
@pytest.mark.parametrize("kind", ["randn", "zeros", "special"])
def test_device_state_gives_the_bytes_of_the_ints(launch, form, shape, kind, monkeypatch):
    if launch == "python":
        monkeypatch.setattr(_extension, "fast_ops", lambda: None)  # new launches take the Python lines
    elif _extension.fast_ops() is None:
        pytest.fail("fp_recipes._torch_ops is not built: the C++ launch cannot be tested")
    x = _input(shape, kind)
    for seed, offset in KEYS:
        want = K.nvfp4_quantize_planned(x, _plan(*FORMS[form]), None, seed, offset, units=(True, False))
        state = _state(seed, offset)
        got = K.nvfp4_quantize_planned(x, _plan(*FORMS[form]), None, 0, 0, units=(True, False), rng_state=state)
        for name, a, b in zip(("data", "scale", "amax", "data_t", "scale_t", "amax_t", "unit", "unit_t"), got, want):
            _same(a, b, f"{form} {shape} {kind} key {seed:#x}/{offset:#x}: {name}")
        assert state.tolist() == [_bits64(seed), _bits64(offset)]  # read, never written by the kernels


@pytest.mark.parametrize("form", ["row_col", "row_rhtcol", "2d"])
def test_device_state_with_an_amax_override_takes_the_general_path(form):
    x = _input((112, 80), "randn")
    amax = x.float().abs().amax() * 2
    seed, offset = KEYS[1]
    want = K.nvfp4_quantize_planned(x, _plan(*FORMS[form]), amax, seed, offset)
    got = K.nvfp4_quantize_planned(x, _plan(*FORMS[form]), amax, 0, 0, rng_state=_state(seed, offset))
    for a, b in zip(got, want):
        _same(a, b, form)


@pytest.mark.parametrize("shape", [(64, 80), (1024, 1024)])
def test_device_state_with_the_fused_bias_gradient(shape):
    x = _input(shape, "randn")
    seed, offset = KEYS[2]
    plan = _plan(*FORMS["row_rhtcol"])
    want = K.nvfp4_quantize_planned_dbias(x, plan, seed, offset, torch.bfloat16)
    got = K.nvfp4_quantize_planned_dbias(x, _plan(*FORMS["row_rhtcol"]), 0, 0, torch.bfloat16,
                                         rng_state=_state(seed, offset))
    assert want is not None and got is not None
    for a, b in zip(got[0], want[0]):
        _same(a, b, "outputs")
    _same(got[1], want[1], "bias gradient")


def test_a_bad_device_state_is_a_clear_error():
    x = _input((32, 32), "randn")
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64, device="cuda"),
                torch.zeros(2, dtype=torch.int32, device="cuda")):
        with pytest.raises(ValueError, match=r"rng_state must be a contiguous int64 tensor of shape \(2,\)"):
            K.nvfp4_quantize_planned(x, _plan(*FORMS["row_col"]), None, 0, 0, rng_state=bad)


def _grad_quantizer(seed: int) -> NVFP4Quantizer:
    spec = QuantizerSpec(role=QuantizerRole("linear", "grad_output"), fmt="nvfp4", scaling="nvfp4", columnwise=True,
                         stochastic_rounding=True, rht_columnwise=True)
    return NVFP4Quantizer(spec, seed=seed)


def test_a_captured_cast_draws_fresh_numbers_at_every_replay():
    """One quantize captured in a CUDA graph and replayed 4 times equals 4 eager casts of a host-int quantizer:
    the counter is read at each replay and advanced by the captured add."""
    host, dev = _grad_quantizer(77), _grad_quantizer(77)
    host.offset = dev.offset = 2**64 - 100  # wraps during the replays
    dev.use_sr_device_state("cuda")
    x = _input((256, 512), "randn")
    dev(x)  # warm-up (plans, workspaces) outside the capture
    host(x)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.synchronize()
        before = dev.offset
        with torch.cuda.graph(graph, stream=side):
            out = dev(x)
    assert dev.offset == before  # capturing launches nothing
    previous = None
    for replay in range(4):
        graph.replay()
        want = host(x)
        for name in ("data", "scale", "amax", "data_t", "scale_t", "amax_t"):
            _same(getattr(out, name), getattr(want, name), f"replay {replay}: {name}")
        assert dev.offset == host.offset
        if previous is not None:
            assert not torch.equal(out.data, previous), "a replay repeated the previous draws"
        previous = out.data.clone()


def test_reading_the_state_inside_a_capture_is_a_clear_error():
    dev = _grad_quantizer(1)
    dev.use_sr_device_state("cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), pytest.raises(RuntimeError, match="cannot be read while a CUDA graph"):
        with torch.cuda.graph(graph, stream=side):
            dev.state_dict()
