"""Delayed scaling inside modules: history and scale step by step, the one-all-reduce rule, a module
called twice in a step, and checkpoint continuity (save -> load -> continue is bit-identical)."""

from __future__ import annotations

import io
import socket

import pytest
import torch
import torch.distributed as dist

import fp_recipes
from fp_recipes import DelayedScaling, Float8CurrentScaling, GroupedLinear, LayerNormLinear, Linear, NVFP4BlockScaling
from fp_recipes.modules import amax_reduction


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def _expected_scale(hist: list, algo: str, margin: int, fmt_max: float, prev: float) -> float:
    """Hand-written rule: amax_ref from the history, scale = (fmt_max / amax_ref) / 2^margin in FP32."""
    amax_ref = max(hist) if algo == "max" else hist[0]
    if not (amax_ref > 0):
        return prev
    s = torch.tensor(fmt_max, dtype=torch.float32) / torch.tensor(amax_ref, dtype=torch.float32)
    return (s / torch.tensor(2.0 ** margin, dtype=torch.float32)).item()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_and_scale_step_by_step(algo):
    torch.manual_seed(0)
    mod = Linear(16, 16, bias=False)
    recipe = DelayedScaling(amax_history_len=3, margin=1, amax_compute_algo=algo)
    amaxes = [3.0, 10.0, 0.5, 0.25, 0.125]
    hist = [0.0, 0.0, 0.0]
    scale = 1.0
    grad_hist = [0.0, 0.0, 0.0]
    grad_scale = 1.0
    for step, a in enumerate(amaxes):
        x = torch.zeros(4, 16)
        x[1, 3] = -a  # amax of the activation this step
        x.requires_grad_(True)
        with fp_recipes.autocast(recipe=recipe):
            y = mod(x)
            qs = mod.quantizer_sets[0]
            # inside the step: the scale is still last step's, the amax is in slot 0
            assert qs.activation.scale.item() == scale
            assert qs.activation.amax_history.tolist() == [_f32(a), *hist[1:]]
        # outermost exit: scale from the history, then roll (slot 0 -> last, older toward 0), zero slot 0
        hist[0] = _f32(a)
        scale = _expected_scale(hist, algo, 1, 448.0, scale)
        hist = [0.0] + hist[2:] + [hist[0]]  # [h0, h1, h2] -> roll -1 -> [h1, h2, h0] -> [0, h2, h0]
        assert qs.activation.scale.item() == scale, f"step {step}"
        assert qs.activation.amax_history.tolist() == hist, f"step {step}"
        # backward: grad_output (E5M2) history is updated when the backward pass ends
        g = torch.zeros(4, 16)
        g[0, 0] = 2.0 * (step + 1)
        y.backward(g)
        grad_hist[0] = _f32(2.0 * (step + 1))
        grad_scale = _expected_scale(grad_hist, algo, 1, 57344.0, grad_scale)
        grad_hist = [0.0] + grad_hist[2:] + [grad_hist[0]]
        assert qs.grad_output.scale.item() == grad_scale
        assert qs.grad_output.amax_history.tolist() == grad_hist


def test_history_roll_matches_hand_written_sequence():
    """The roll convention spelled out literally for length 3: [a, 0, 0] -> [0, 0, a] -> [0, a, b]."""
    mod = Linear(16, 16, bias=False)
    recipe = DelayedScaling(amax_history_len=3)
    seen = []
    for a in (1.0, 2.0, 4.0, 8.0):
        x = torch.full((2, 16), a)
        with fp_recipes.autocast(recipe=recipe):
            mod(x)
        seen.append(mod.quantizer_sets[0].activation.amax_history.tolist())
    assert seen == [[0.0, 0.0, 1.0], [0.0, 1.0, 2.0], [0.0, 2.0, 4.0], [0.0, 4.0, 8.0]]
    # max over the history at step 4 was max(2, 4, 8) = 8 -> 448 / 8
    assert mod.quantizer_sets[0].activation.scale.item() == 56.0


def test_module_called_twice_in_one_step_max_accumulates():
    """Both calls use the same (old) scale; the step's amax is the max over both calls."""
    mod = Linear(16, 16, bias=False)
    recipe = DelayedScaling(amax_history_len=2)
    with fp_recipes.autocast(recipe=recipe):
        mod(torch.full((2, 16), 1.0))  # scale -> 448
    x_small, x_big = torch.full((2, 16), 0.5), torch.full((2, 16), 3.0)
    with fp_recipes.autocast(recipe=recipe):
        y1 = mod(x_small)
        q = mod.quantizer_sets[0].activation
        assert q.scale.item() == 448.0
        y2 = mod(x_big)
        assert q.scale.item() == 448.0  # unchanged inside the step
        assert q.amax_history[0].item() == 3.0
        y3 = mod(x_small)
        assert q.amax_history[0].item() == 3.0  # max-accumulated, not overwritten
    assert torch.equal(y1, y3)
    assert q.scale.item() == _f32(448.0 / 3.0)
    (y1.sum() + y2.sum()).backward()  # two backward calls of one module in one pass
    g = mod.quantizer_sets[0].grad_output
    assert g.amax_history.tolist() == [0.0, 1.0] and g.scale.item() == 57344.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        created = True
    yield dist.new_group([0])
    if created:
        dist.destroy_process_group()


def test_one_all_reduce_per_forward_and_per_backward(gloo_group, monkeypatch):
    calls = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((tuple(tensor.shape), op, group))
        return real(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", counting)
    torch.manual_seed(1)
    model = torch.nn.ModuleDict({
        "a": Linear(16, 32), "b": LayerNormLinear(32, 32), "c": GroupedLinear(3, 32, 16)})
    recipe = DelayedScaling()
    x = torch.randn(12, 16, requires_grad=True)
    with fp_recipes.autocast(recipe=recipe, amax_reduction_group=gloo_group):
        with fp_recipes.autocast(recipe=recipe, amax_reduction_group=gloo_group):  # nested: no extra reduce
            h = model["a"](x)
        h = model["b"](h)
        h = model["a"](h[:, :16])  # module "a" twice in the step
        y = model["c"](h, [4, 0, 8])
        assert calls == []  # nothing while the forward runs
    # one reduction of all forward amaxes: activation+weight of a (once, though called twice), of b,
    # the 3 expert weights and the activations of the 2 experts that had rows
    assert len(calls) == 1
    assert calls[0][0] == (2 + 2 + 3 + 2,) and calls[0][1] == dist.ReduceOp.MAX and calls[0][2] is gloo_group
    y.sum().backward()
    # one more for the backward: grad_output of a, b and the two experts that had rows
    assert len(calls) == 2 and calls[1][0] == (1 + 1 + 2,)
    # no group -> no collective, but scales still update
    with fp_recipes.autocast(recipe=recipe):
        model["a"](x)
    assert len(calls) == 2
    assert model["a"].quantizer_sets[0].activation.scale.item() != 1.0


def test_reduce_amax_false_skips_collective(gloo_group, monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1))
    mod = Linear(16, 16)
    with fp_recipes.autocast(recipe=DelayedScaling(reduce_amax=False), amax_reduction_group=gloo_group):
        mod(torch.randn(4, 16))
    assert calls == [] and mod.quantizer_sets[0].activation.scale.item() != 1.0


# ------------------------------------------------------------------------------------ checkpoints

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = LayerNormLinear(32, 64, normalization="RMSNorm")
        self.l2 = Linear(64, 32)
        self.moe = GroupedLinear(2, 32, 16)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = self.l2(h)
        return self.moe(h, [16, x.shape[0] - 16])


def _train(model, opt, recipe, steps, seed0):
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed0 + s)
        x = torch.randn(32, 32, generator=g)
        t = torch.randn(32, 16, generator=g)
        with fp_recipes.autocast(recipe=recipe):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y, t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


@pytest.mark.parametrize("recipe_fn", [lambda: DelayedScaling(amax_history_len=4),
                                       lambda: NVFP4BlockScaling(),
                                       lambda: Float8CurrentScaling()], ids=["delayed", "nvfp4_sr", "current"])
def test_checkpoint_continuity_bit_identical(recipe_fn):
    recipe = recipe_fn()
    torch.manual_seed(3)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(model, opt, recipe, 3, 0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    cont = _train(model, opt, recipe, 3, 100)
    params = [p.detach().clone() for p in model.parameters()]

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    torch.manual_seed(999)  # a different init: everything must come from the checkpoint
    model2 = _Net()
    model2.load_state_dict(ckpt["model"])  # strict: quantizer state is accepted before it is built
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    opt2.load_state_dict(ckpt["opt"])
    cont2 = _train(model2, opt2, recipe, 3, 100)
    assert all(torch.equal(a, b) for a, b in zip(cont, cont2)), (cont, cont2)
    assert all(torch.equal(a, b) for a, b in zip(params, model2.parameters()))
    sd, sd2 = model.state_dict(), model2.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        if isinstance(sd[k], torch.Tensor):
            assert torch.equal(sd[k], sd2[k]), k
        else:
            assert sd[k] == sd2[k], k


def test_delayed_state_is_in_state_dict_and_loads_into_built_module():
    mod = Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=2)
    with fp_recipes.autocast(recipe=recipe):
        mod(torch.randn(4, 16) * 7)
    sd = mod.state_dict()
    assert {"qstate_activation0_scale", "qstate_activation0_amax_history", "qstate_weight0_scale",
            "qstate_grad_output0_scale"} <= set(sd)
    other = Linear(16, 16)
    with fp_recipes.autocast(recipe=recipe):
        other(torch.randn(4, 16))
    q = other.quantizer_sets[0].activation
    scale_obj = q.scale
    other.load_state_dict(sd)
    assert q.scale is scale_obj  # loaded in place: the quantizer still owns the buffer
    assert torch.equal(q.scale, sd["qstate_activation0_scale"])
    # a torch.nn.Linear checkpoint (no quantizer state) loads strictly too
    other.load_state_dict(torch.nn.Linear(16, 16).state_dict())


def test_sr_state_in_extra_state():
    mod = Linear(32, 16)
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        y = mod(torch.randn(16, 32))
    y.sum().backward()
    g = mod.quantizer_sets[0].grad_output
    assert g.offset > 0
    extra = mod.state_dict()["_extra_state"]["quantizer_state"]
    assert extra["grad_output0"] == {"seed": g.seed, "offset": g.offset}
    # distinct modules draw distinct SR streams
    mod2 = Linear(32, 16)
    with fp_recipes.autocast(recipe=NVFP4BlockScaling()):
        mod2(torch.randn(16, 32))
    assert mod2.quantizer_sets[0].grad_output.seed != g.seed


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_batched_scale_update_is_update_scale_bit_for_bit(algo):
    """The reducer updates many Float8Quantizers in one batch; it must equal update_scale() exactly,
    including zero/NaN/Inf/subnormal amaxes (scale kept, FLT_MAX on overflow)."""
    from fp_recipes.modules.amax_reduction import batched_update_scales
    from fp_recipes.quantizers.float8 import Float8Quantizer
    from fp_recipes.quantizers.roles import QuantizerRole, QuantizerSpec

    torch.manual_seed(0)
    specials = [0.0, float("nan"), float("inf"), 1e-45, 3e38, 1.0]
    batch, single = [], []
    for i in range(12):
        spec = QuantizerSpec(role=QuantizerRole("linear", "activation", i), fmt="e4m3" if i % 2 else "e5m2",
                             scaling="delayed", amax_history_len=4, margin=i % 3, amax_compute_algo=algo)
        h = torch.rand(4) * 10
        if i < len(specials):
            h[0] = specials[i]
        if i == 7:
            h.zero_()
        for lst in (batch, single):
            q = Float8Quantizer(spec)
            q.amax_history.copy_(h)
            q.scale.fill_(0.5 + i)
            lst.append(q)
    batched_update_scales(batch)
    for q in single:
        q.update_scale()
    for a, b in zip(batch, single):
        assert torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32))
        assert torch.equal(a.amax_history.nan_to_num(-1), b.amax_history.nan_to_num(-1))


def test_module_to_keeps_quantizer_bound_to_fp32_buffers():
    mod = Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=2)
    with fp_recipes.autocast(recipe=recipe):
        mod(torch.randn(4, 16) * 3)
    mod.to(torch.bfloat16)
    q = mod.quantizer_sets[0].activation
    assert mod.qstate_activation0_scale.dtype == torch.float32
    assert q.scale is mod.qstate_activation0_scale and q.amax_history is mod.qstate_activation0_amax_history
    with fp_recipes.autocast(recipe=recipe):
        y = mod(torch.randn(4, 16, dtype=torch.bfloat16) * 5)
    assert y.dtype == torch.bfloat16
    assert mod.qstate_activation0_amax_history[-1].item() > 0  # the update went into the module's buffer


def test_delayed_step_assigns_no_host_scalars(monkeypatch):
    """`t[i] = 0.0` into a CUDA tensor copies a host scalar and synchronises the stream (found with
    torch.cuda.set_sync_debug_mode on an H200); a training step must not do it. Checked on CPU by
    watching Tensor.__setitem__ through a whole delayed-scaling step (forward, exit, backward)."""
    seen = []
    real = torch.Tensor.__setitem__

    def spy(self, idx, value):
        if isinstance(value, (int, float, bool)):
            import traceback
            seen.append(traceback.extract_stack(limit=3)[0])
        return real(self, idx, value)

    model = torch.nn.ModuleDict({"a": Linear(16, 16), "g": GroupedLinear(2, 16, 16)})
    x = torch.randn(8, 16, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=4)
    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    for _ in range(2):
        with fp_recipes.autocast(recipe=recipe):
            y = model["g"](model["a"](x), [3, 5])
        y.sum().backward()
    assert seen == []


def test_checkpoint_continuity_grouped_fp8_multi_cast(monkeypatch):
    from fp_recipes.modules import grouped_linear as GL

    monkeypatch.setattr(GL, "MULTI_CAST", True)
    test_checkpoint_continuity_bit_identical(lambda: DelayedScaling(amax_history_len=4))


def test_batched_scale_update_reuses_its_plan_across_steps():
    """The batched update caches its buffers and views per set of quantizers; step after step (new
    amaxes each time, the history rolling) it must keep equalling update_scale() bit for bit."""
    from fp_recipes.quantizers.float8 import Float8Quantizer
    from fp_recipes.quantizers.roles import QuantizerRole, QuantizerSpec

    torch.manual_seed(3)
    batch, single = [], []
    for i in range(5):
        spec = QuantizerSpec(role=QuantizerRole("linear", "weight", i), fmt="e4m3", scaling="delayed",
                             amax_history_len=3, margin=0, amax_compute_algo="max")
        batch.append(Float8Quantizer(spec))
        single.append(Float8Quantizer(spec))
    for step in range(6):
        amax = torch.rand(5) * 10 ** step
        if step == 2:
            amax[1] = float("nan")
        for a, b, v in zip(batch, single, amax):
            a.record_amax(v)
            b.record_amax(v)
        amax_reduction.batched_update_scales(batch)
        for q in single:
            q.update_scale()
        for a, b in zip(batch, single):
            assert torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32)), step
            assert torch.equal(a.amax_history.nan_to_num(-1), b.amax_history.nan_to_num(-1)), step
    key = tuple((id(q.amax_history), id(q.scale)) for q in batch)
    assert key in amax_reduction._PLANS  # one plan, reused
