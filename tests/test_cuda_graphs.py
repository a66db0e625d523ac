"""fp_recipes.make_graphed_callables: CUDA graphs of training steps under a recipe (docs/cuda_graphs.md).

GPU tests compare graph replays with eager execution bit for bit, step by step (outputs, input and
parameter grads, the whole state dict: weights, amax histories, scales), with data changing every step
and an optimizer step between replays. CPU tests cover the argument checks made before any capture.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import fp_recipes
from fp_recipes import graphs as graphs_module
from fp_recipes import (DelayedScaling, Float8CurrentScaling, GroupedLinear, LayerNormLinear, Linear,
                        NVFP4BlockScaling, make_graphed_callables)

H = 64
TOKENS = 32


# ----------------------------------------------------------------------------------------------
# CPU: argument checks


def test_exported_from_the_root():
    assert fp_recipes.make_graphed_callables is make_graphed_callables


def test_refuses_a_cpu_module():
    with pytest.raises(ValueError, match=r"weight on cpu.*module\.cuda\(\)"):
        make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),), recipe=Float8CurrentScaling())


def test_refuses_a_non_callable():
    with pytest.raises(TypeError, match="not an nn.Module or function"):
        make_graphed_callables(3, (torch.randn(2, 2),))


def test_refuses_mismatched_sample_args():
    with pytest.raises(TypeError, match="tuple of 2 callables needs"):
        make_graphed_callables((Linear(H, H), Linear(H, H)), ((torch.randn(TOKENS, H),),))


def test_refuses_a_capture_inside_autocast():
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        with pytest.raises(RuntimeError, match="outside fp_recipes.autocast"):
            make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_refuses_bad_warmup_counts(bad):
    with pytest.raises(ValueError, match="num_warmup_iters"):
        make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),), num_warmup_iters=bad)


def test_te_aliases_conflict_and_calibrate():
    with pytest.raises(ValueError, match="disagree"):
        make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),), weight_caching=True,
                               fp8_weight_caching=False)
    with pytest.raises(ValueError, match="fp8_calibrate"):
        make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),), fp8_calibrate=True)
    # an alias alone is taken: the CPU module is what fails next
    with pytest.raises(ValueError, match="on cpu"):
        make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),), fp8_enabled=True,
                               fp8_recipe=DelayedScaling())


def test_refuses_a_sample_argument_with_autograd_history():
    x = torch.randn(TOKENS, H, requires_grad=True) * 2  # not a leaf
    with pytest.raises(ValueError, match=r"requires grad but is not a leaf.*detach\(\)\.requires_grad_\(\)"):
        graphs_module._check_sample_args((x,), 0)


def test_refuses_stochastic_rounding_in_a_plain_function():
    lin = Linear(H, H)
    with pytest.raises(TypeError, match="plain function.*stochastic rounding: pass the nn.Module"):
        make_graphed_callables(lambda x: lin(x), (torch.randn(TOKENS, H),), recipe=NVFP4BlockScaling())
    # a module with stochastic rounding passes the recipe checks: the CPU module is what fails next
    with pytest.raises(ValueError, match="on cpu"):
        make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),), recipe=NVFP4BlockScaling())


def test_prepare_for_capture_builds_the_state_and_moves_the_sr_counters():
    model = torch.nn.Sequential(LayerNormLinear(H, H), Linear(H, H))
    assert graphs_module.prepare_for_capture(model, NVFP4BlockScaling()) is model
    quantizers = [q for m in model.modules() for qs in (getattr(m, "quantizer_sets", None) or ())
                  for q in qs.quantizers.values() if q is not None]
    assert len(quantizers) == 6
    for q in quantizers:  # (on the parameters' device: the CPU here)
        assert (q._rng_d is not None) == q.spec.stochastic_rounding == (q.spec.role.tensor.value == "grad_output")


def test_delayed_scaling_captured_under_an_autocast_entered_outside_the_capture_is_an_error(monkeypatch):
    """A graph captured by hand inside an autocast entered before the capture: the autocast's exit (the scale
    update) runs once, eagerly, and never on replay, so the scales would freeze. Refused at that exit. (The capture
    is simulated through torch's check of the current stream; on a GPU the same check sees a real capture.)"""
    from fp_recipes.modules.amax_reduction import reducer

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    layer, x, recipe = Linear(H, H), torch.randn(TOKENS, H), DelayedScaling()
    with pytest.raises(RuntimeError, match="entered outside the capture.*inside the captured region"):
        with fp_recipes.autocast(recipe=recipe):
            capturing[0] = True
            layer(x)
            capturing[0] = False
    assert reducer.pending_forward() == 0
    scale = layer.quantizer_sets[0].activation.scale.clone()
    capturing[0] = True  # the autocast inside the capture (as make_graphed_callables enters it): its exit is captured
    with fp_recipes.autocast(recipe=recipe):
        layer(x * 1000)
    capturing[0] = False
    with fp_recipes.autocast(recipe=recipe):  # an eager region after it updates as usual
        layer(x * 1000)
    assert not torch.equal(layer.quantizer_sets[0].activation.scale, scale)


def test_refuses_a_plain_function_under_delayed_scaling():
    lin = Linear(H, H)
    with pytest.raises(TypeError, match="plain function"):
        make_graphed_callables(lambda x: lin(x), (torch.randn(TOKENS, H),), recipe=DelayedScaling())


def test_refuses_a_gloo_amax_reduction():
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not initialised by another test")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        with pytest.raises(RuntimeError, match="gloo group, which cannot be captured"):
            make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),), recipe=DelayedScaling(),
                                   amax_reduction_group=group)
        # without a reduction (reduce_amax=False) the group does not matter: the CPU module fails next
        with pytest.raises(ValueError, match="on cpu"):
            make_graphed_callables(Linear(H, H), (torch.randn(TOKENS, H),),
                                   recipe=DelayedScaling(reduce_amax=False), amax_reduction_group=group)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# GPU: bitwise against eager


def _block() -> torch.nn.Module:
    return torch.nn.Sequential(LayerNormLinear(H, H), Linear(H, H)).cuda()


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: max |diff| {(a.double() - b.double()).abs().max().item()}"


def _same_state(graphed: torch.nn.Module, ref: torch.nn.Module, step: int) -> None:
    gs, rs = graphed.state_dict(), ref.state_dict()
    assert gs.keys() == rs.keys(), (step, sorted(set(gs) ^ set(rs)))
    for k in gs:
        if isinstance(gs[k], torch.Tensor):
            _same(gs[k], rs[k], f"step {step}: {k}")
        else:
            assert gs[k] == rs[k], (step, k)


def _data(step: int, shape=(TOKENS, H)):
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    x = torch.randn(*shape, device="cuda", generator=g) * (1.0 + step)  # amaxes change every step
    dy = torch.randn(*shape, device="cuda", generator=g) * (0.5 + 0.25 * step)
    return x, dy


def _compare(recipe, models, steps: int = 5, outer=contextlib.nullcontext):
    """``models``: eager modules (a tuple: run in sequence). Graph copies of them, run both, compare.
    ``outer()``: a context entered around the capture and every forward, graphed and eager (e.g.
    torch.autocast)."""
    torch.manual_seed(0)
    single = not isinstance(models, tuple)
    models = (models,) if single else models
    refs = tuple(copy.deepcopy(m) for m in models)
    samples = tuple((torch.randn(TOKENS, H, device="cuda", requires_grad=True),) for _ in models)
    with outer():
        graphed = make_graphed_callables(models[0] if single else models, samples[0] if single else samples,
                                         recipe=recipe)
    graphed = (graphed,) if single else graphed
    opt_g = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.05)
    opt_r = torch.optim.SGD([p for m in refs for p in m.parameters()], lr=0.05)
    for step in range(steps):
        x, dy = _data(step)
        xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        with outer(), fp_recipes.autocast(recipe=recipe):
            yr = xr
            for m in refs:
                yr = m(yr)
        yr.backward(dy.to(yr.dtype))
        with outer():
            yg = xg
            for m in graphed:
                yg = m(yg)
        yg.backward(dy.to(yg.dtype))
        _same(yg, yr, f"step {step}: output")
        _same(xg.grad, xr.grad, f"step {step}: input grad")
        for i, (m, r) in enumerate(zip(models, refs)):
            for (name, p), q in zip(m.named_parameters(), r.parameters()):
                _same(p.grad, q.grad, f"step {step}: callable {i} grad of {name}")
            _same_state(m, r, step)
        opt_g.step()
        opt_r.step()
        opt_g.zero_grad(set_to_none=True)
        opt_r.zero_grad(set_to_none=True)
        for i, (m, r) in enumerate(zip(models, refs)):
            _same_state(m, r, step)  # the weights after the optimizer step
    return models, refs


def _scales(m: torch.nn.Module):
    return {k: v for k, v in m.state_dict().items() if k.endswith("_scale")}


@pytest.mark.cuda
def test_delayed_scaling_equals_eager():
    recipe = DelayedScaling(amax_history_len=4)
    models, _ = _compare(recipe, _block(), steps=6)
    scales = _scales(models[0])
    assert scales and any(not torch.equal(s, torch.ones_like(s)) for s in scales.values()), \
        "the replays must have updated the scales"


@pytest.mark.cuda
def test_delayed_scaling_most_recent_equals_eager():
    _compare(DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent", margin=1), _block(), steps=4)


@pytest.mark.cuda
def test_current_scaling_equals_eager():
    _compare(Float8CurrentScaling(), _block(), steps=4)


@pytest.mark.cuda
def test_nvfp4_equals_eager():
    _compare(NVFP4BlockScaling(disable_stochastic_rounding=True), _block(), steps=4)


def _sr_offsets(m: torch.nn.Module) -> list:
    return [q.offset for mod in m.modules() for qs in (getattr(mod, "quantizer_sets", None) or ())
            for q in qs.quantizers.values() if q is not None and getattr(q.spec, "stochastic_rounding", False)]


@pytest.mark.cuda
def test_nvfp4_with_stochastic_rounding_equals_eager():
    """The default NVFP4 recipe (SR on the gradients): each replay draws with the counter eager execution would
    use at that step (a counter baked into the graph would repeat the first step's draws and differ from eager
    from step 1 on), and leaves the counters where eager leaves them (compared in the state dict)."""
    models, refs = _compare(NVFP4BlockScaling(), _block(), steps=4)
    graphed_offsets, eager_offsets = _sr_offsets(models[0]), _sr_offsets(refs[0])
    assert graphed_offsets and graphed_offsets == eager_offsets and all(o > 0 for o in graphed_offsets)


class _Experts(torch.nn.Module):
    """A LayerNormLinear, then three experts of a GroupedLinear with fixed splits (one expert empty: the splits are a
    constant of the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = LayerNormLinear(H, H)
        self.experts = GroupedLinear(3, H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.ln(x), [16, 0, TOKENS - 16])


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), NVFP4BlockScaling()], ids=["delayed", "nvfp4_sr"])
def test_grouped_linear_equals_eager(recipe):
    """GroupedLinear's per-expert quantizers in a graph: delayed-scaling state and, with the default NVFP4 recipe,
    every expert's gradient counter on the device (bit for bit as eager, counters in the state dict)."""
    _compare(recipe, _Experts().cuda(), steps=3)


def _raw_step(model, recipe, x, dy):
    with fp_recipes.autocast(recipe=recipe):
        y = model(x)
    y.backward(dy)
    return y


def _warm_up(model, recipe, x, dy, steps: int = 1) -> None:
    """Eager steps on a side stream before a capture made by hand (as torch's graph examples do)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            _raw_step(model, recipe, x, dy)
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.cuda
def test_a_raw_capture_of_stochastic_rounding_with_the_counter_on_the_host_is_an_error():
    """torch.cuda.graph around a stochastically rounded cast whose counter is a host int would replay the same
    draws at every step: refused when the cast is captured."""
    recipe, model = NVFP4BlockScaling(), _block()
    x = torch.randn(TOKENS, H, device="cuda", requires_grad=True)
    dy = torch.randn(TOKENS, H, device="cuda")
    _warm_up(model, recipe, x, dy)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="Philox counter on the host.*prepare_for_capture"):
        with torch.cuda.graph(graph):
            _raw_step(model, recipe, x, dy)


@pytest.mark.cuda
def test_a_raw_capture_of_delayed_scaling_needs_the_autocast_inside_it():
    """torch.cuda.graph inside an autocast entered before it: refused at the autocast's exit (replays would never
    update the scales). With the autocast inside the captured region, replays update the scales as eager steps do."""
    recipe = DelayedScaling(amax_history_len=2)
    model = _block()
    ref = copy.deepcopy(model)
    x = torch.randn(TOKENS, H, device="cuda", requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    dy = torch.randn(TOKENS, H, device="cuda")
    _warm_up(model, recipe, x, dy)
    _raw_step(ref, recipe, xr, dy)
    with pytest.raises(RuntimeError, match="entered outside the capture"):
        with fp_recipes.autocast(recipe=recipe):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                model(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _raw_step(model, recipe, x, dy)
    for step in range(3):
        with torch.no_grad():
            x.mul_(1.5)  # the amaxes move: the scales must follow
            xr.mul_(1.5)
        graph.replay()
        yr = _raw_step(ref, recipe, xr, dy)
        _same(y, yr, f"replay {step}: output")
        _same_state(model, ref, step)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), NVFP4BlockScaling(disable_stochastic_rounding=True)],
                         ids=["current", "nvfp4_rn"])
def test_a_raw_capture_casts_the_weights_in_the_graph(recipe):
    """torch.cuda.graph around forward + backward after eager warm-up steps that filled the modules' weight caches:
    the capture casts the weights anyway, so replays after optimizer steps (which change the weights in place)
    equal eager steps. A cached copy read by the graph would be stale after the first step."""
    model = _block()
    ref = copy.deepcopy(model)
    x = torch.randn(TOKENS, H, device="cuda", requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    dy = torch.randn(TOKENS, H, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    # the second forward reuses the first's weight casts: the cache keeps copies
    _warm_up(model, recipe, x, dy, steps=2)
    for _ in range(2):
        _raw_step(ref, recipe, xr, dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _raw_step(model, recipe, x, dy)
    for step in range(3):
        opt.step()  # in place: the graph reads the new weights
        opt_r.step()
        graph.replay()
        yr = _raw_step(ref, recipe, xr, dy)
        _same(y, yr, f"replay {step} after an optimizer step: output")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _same(p.grad, q.grad, f"replay {step}: grad of {name}")


@pytest.mark.cuda
def test_a_raw_capture_after_prepare_for_capture_replays_fresh_draws():
    """fp_recipes.graphs.prepare_for_capture, then torch.cuda.graph around forward + backward: each replay equals the
    next eager step of a copy (outputs, accumulated grads, SR counters), so no replay repeats another's draws."""
    recipe, model = NVFP4BlockScaling(), _block()
    ref = copy.deepcopy(model)
    graphs_module.prepare_for_capture(model, recipe)
    x = torch.randn(TOKENS, H, device="cuda", requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    dy = torch.randn(TOKENS, H, device="cuda")
    _warm_up(model, recipe, x, dy)  # matched by one eager step of the copy
    _raw_step(ref, recipe, xr, dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _raw_step(model, recipe, x, dy)
    outputs = []
    for step in range(3):
        graph.replay()
        yr = _raw_step(ref, recipe, xr, dy)
        _same(y, yr, f"replay {step}: output")
        _same(x.grad, xr.grad, f"replay {step}: input grad")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _same(p.grad, q.grad, f"replay {step}: grad of {name}")
        assert _sr_offsets(model) == _sr_offsets(ref)
        outputs.append(x.grad.clone())
    assert not torch.equal(outputs[1] - outputs[0], outputs[2] - outputs[1]), "two replays drew the same numbers"


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(),
                                    NVFP4BlockScaling()], ids=["delayed", "current", "nvfp4_sr"])
def test_two_blocks_equal_eager(recipe):
    _compare(recipe, (_block(), _block()), steps=4)


def _bf16_autocast():
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(),
                                    NVFP4BlockScaling(disable_stochastic_rounding=True), NVFP4BlockScaling()],
                         ids=["delayed", "current", "nvfp4", "nvfp4_sr"])
def test_capture_under_torch_autocast_equals_eager(recipe):
    """FP32 parameters under torch.autocast(bfloat16) (how Hugging Face / FSDP2 jobs run): the capture
    records the autocast's casts; replays inside the same autocast equal eager steps bit for bit."""
    models, _ = _compare(recipe, _block(), steps=4, outer=_bf16_autocast)
    assert next(models[0].parameters()).dtype == torch.float32


class _Checkpointed(torch.nn.Module):
    """A block whose forward is recomputed in the backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), NVFP4BlockScaling()],
                         ids=["delayed", "current", "nvfp4_sr"])
def test_activation_checkpointing_inside_the_capture_equals_eager(recipe):
    """The recomputation runs inside the captured backward: it must reuse the forward's scales and record
    no amax twice, exactly as eager checkpointing does."""
    _compare(recipe, _Checkpointed().cuda(), steps=4)


@pytest.mark.cuda
def test_weight_caching_equals_eager_microbatches():
    """fp8_weight_caching: is_first_microbatch=True casts (and keeps) the weight, False reuses it; three
    micro-batches per optimizer step, as eager with the same flags."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    model = Linear(H, H).cuda()
    ref = copy.deepcopy(model)
    sample = torch.randn(TOKENS, H, device="cuda", requires_grad=True)
    make_graphed_callables(model, (sample,), recipe=recipe, fp8_weight_caching=True)
    opt_g = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        for mb in range(3):
            x, dy = _data(10 * step + mb)
            xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            with fp_recipes.autocast(recipe=recipe):
                yr = ref(xr, is_first_microbatch=mb == 0)
            yr.backward(dy)
            yg = model(xg, is_first_microbatch=mb == 0)
            yg.backward(dy)
            _same(yg, yr, f"step {step}.{mb}: output")
            _same(xg.grad, xr.grad, f"step {step}.{mb}: input grad")
            _same(model.weight.grad, ref.weight.grad, f"step {step}.{mb}: accumulated weight grad")
            _same_state(model, ref, step)
        opt_g.step()
        opt_r.step()
        opt_g.zero_grad(set_to_none=True)
        opt_r.zero_grad(set_to_none=True)


@pytest.mark.cuda
def test_grad_accumulation_without_weight_caching():
    """Two backwards into the same .grad: the graph's static grad buffer must not become .grad."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    model = Linear(H, H).cuda()
    ref = copy.deepcopy(model)
    make_graphed_callables(model, (torch.randn(TOKENS, H, device="cuda", requires_grad=True),), recipe=recipe)
    for mb in range(3):
        x, dy = _data(mb)
        with fp_recipes.autocast(recipe=recipe):
            ref(x.clone().requires_grad_()).backward(dy)
        model(x.clone().requires_grad_()).backward(dy)
        _same(model.weight.grad, ref.weight.grad, f"micro-batch {mb}: accumulated weight grad")


@pytest.mark.cuda
def test_call_inside_the_same_recipe_is_allowed_and_another_is_refused():
    recipe = DelayedScaling(amax_history_len=2)
    model = make_graphed_callables(_block(), (torch.randn(TOKENS, H, device="cuda", requires_grad=True),),
                                   recipe=recipe)
    x, dy = _data(0)
    with fp_recipes.autocast(recipe=DelayedScaling(amax_history_len=2)):  # equal recipe: fine
        model(x.clone().requires_grad_()).backward(dy)
    with fp_recipes.autocast(recipe=Float8CurrentScaling()):
        with pytest.raises(RuntimeError, match="captured under"):
            model(x.clone().requires_grad_())
    with fp_recipes.autocast(enabled=False):
        with pytest.raises(RuntimeError, match="captured under"):
            model(x.clone().requires_grad_())


@pytest.mark.cuda
def test_bad_calls_are_refused():
    recipe = Float8CurrentScaling()
    model = make_graphed_callables(_block(), (torch.randn(TOKENS, H, device="cuda", requires_grad=True),),
                                   recipe=recipe)
    with pytest.raises(ValueError, match="captured for"):
        model(torch.randn(2 * TOKENS, H, device="cuda", requires_grad=True))
    with pytest.raises(ValueError, match="captured for"):
        model(torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    with pytest.raises(ValueError, match="requires_grad=False, captured with True"):
        model(torch.randn(TOKENS, H, device="cuda"))
    with pytest.raises(TypeError, match="weight_caching=True"):
        model(torch.randn(TOKENS, H, device="cuda", requires_grad=True), is_first_microbatch=True)
    with pytest.raises(TypeError, match="structured"):
        model(torch.randn(TOKENS, H, device="cuda", requires_grad=True), torch.randn(1, device="cuda"))


@pytest.mark.cuda
def test_refuses_a_cpu_sample_argument():
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors"):
        make_graphed_callables(_block(), (torch.randn(TOKENS, H),), recipe=Float8CurrentScaling())


@pytest.mark.cuda
def test_replaced_state_and_storage_are_refused():
    recipe = DelayedScaling(amax_history_len=2)
    model = make_graphed_callables(_block(), (torch.randn(TOKENS, H, device="cuda", requires_grad=True),),
                                   recipe=recipe)
    x = torch.randn(TOKENS, H, device="cuda", requires_grad=True)
    model(x)  # fine
    model[1].reset_quantizer_state()
    with pytest.raises(RuntimeError, match="rebuilt after capture"):
        model(x)
    other = make_graphed_callables(_block(), (torch.randn(TOKENS, H, device="cuda", requires_grad=True),),
                                   recipe=recipe)
    with torch.no_grad():
        other[1].weight.data = other[1].weight.data.clone()
    with pytest.raises(RuntimeError, match="new storage"):
        other(x)


@pytest.mark.cuda
def test_eval_mode_runs_eagerly_under_the_captured_recipe():
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    model = _block()
    ref = copy.deepcopy(model)
    make_graphed_callables(model, (torch.randn(TOKENS, H, device="cuda", requires_grad=True),), recipe=recipe)
    model.eval()
    ref.eval()
    x, _ = _data(3)
    with torch.no_grad():
        with fp_recipes.autocast(recipe=recipe):
            want = ref(x)
        got = model(x)
    _same(got, want, "eval output")


@pytest.mark.cuda
def test_the_warmup_leaves_the_state_as_it_was():
    recipe = DelayedScaling(amax_history_len=4)
    model = _block()
    for m in model:
        m.init_quantizer_state(recipe)
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    make_graphed_callables(model, ((torch.randn(TOKENS, H, device="cuda") * 100).requires_grad_(),),
                           recipe=recipe, num_warmup_iters=3)
    after = model.state_dict()
    for k, v in before.items():
        _same(after[k], v, k)


# ----------------------------------------------------------------------------------------------
# GPU: non-finite reports under capture


@pytest.mark.cuda
def test_a_nonfinite_amax_in_a_replay_warns():
    from fp_recipes.quantizers.nonfinite import NonFiniteAmaxWarning

    model = Linear(H, H).cuda()
    graphed = make_graphed_callables(model, (torch.randn(TOKENS, H, device="cuda", requires_grad=True),),
                                     recipe=DelayedScaling())
    x = torch.randn(TOKENS, H, device="cuda")
    x[3, 5] = float("inf")
    with pytest.warns(NonFiniteAmaxWarning, match=r"linear\[0\]\.activation"):
        for _ in range(4):  # the flag set by a replay is read without a wait: one or two replays later
            graphed(x.clone().requires_grad_()).sum().backward()
            torch.cuda.synchronize()


class _Q:  # a quantizer identity for the report registry (no flag is set, so nothing is warned)
    pass


@pytest.mark.cuda
def test_reports_are_deferred_on_the_capture_stream_only():
    """The deferral is registered for one capture stream: a report on another stream or thread runs as
    usual (starts its flag copy), one about the capture's quantizers made eagerly is counted as outside,
    and one made on the capturing stream is collected for the replays (no host work)."""
    import threading

    from fp_recipes.quantizers.nonfinite import DeferredReports, NonfiniteWatch

    dev = torch.device("cuda")
    mine, other = _Q(), _Q()
    stream = torch.cuda.Stream()
    with DeferredReports(stream, [mine]) as reports:
        with pytest.raises(RuntimeError, match="already deferred"):
            DeferredReports(stream, [other]).__enter__()
        elsewhere = NonfiniteWatch(1, dev)
        elsewhere.report([other])
        assert elsewhere._copying and reports.outside == 0
        in_thread = NonfiniteWatch(1, dev)
        t = threading.Thread(target=in_thread.report, args=([mine],))
        t.start()
        t.join()
        assert in_thread._copying and reports.outside == 1  # an eager update of a captured module's state
        captured = NonfiniteWatch(1, dev)
        buf = torch.zeros(4, device=dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            buf.add_(1.0)
            captured.report([mine])
            captured.report([mine])
        assert not captured._copying
        assert [(w, qs) for w, qs in reports.take()] == [(captured, [mine])]
        # a capture on another stream has no registry: its reports are skipped, nothing is collected
        skipped = NonfiniteWatch(1, dev)
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream()):
            buf.add_(1.0)
            skipped.report([mine])
        assert not skipped._copying and reports.take() == []
    # unregistered: the same stream reports as usual again
    with torch.cuda.stream(stream):
        after = NonfiniteWatch(1, dev)
        after.report([mine])
        assert after._copying
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_capture_survives_garbage_holding_older_graphs():
    """An earlier graphed model left in a reference cycle holds CUDA graphs; if Python's collector frees it
    during a later capture, the graph's destruction is refused on the capturing stream and invalidates
    that capture. make_graphed_callables collects first and keeps the collector off while capturing (here
    the collector would otherwise run at almost every allocation)."""
    import gc

    for _ in range(2):
        old = Linear(H, H).cuda()
        old_graphed = make_graphed_callables(old, (torch.randn(TOKENS, H, device="cuda", requires_grad=True),),
                                             recipe=DelayedScaling())
        old.cycle = [old, old_graphed]  # unreachable once the names go: only the cyclic collector frees it
        del old, old_graphed
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        model = Linear(H, H).cuda()
        graphed = make_graphed_callables(model, (torch.randn(TOKENS, H, device="cuda", requires_grad=True),),
                                         recipe=DelayedScaling())
    finally:
        gc.set_threshold(*thresholds)
    assert gc.isenabled()
    x = torch.randn(TOKENS, H, device="cuda", requires_grad=True)
    graphed(x).sum().backward()
    torch.cuda.synchronize()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_no_cyclic_gc_during_capture_restores_the_collector():
    """The capture guard collects first, keeps the cyclic collector off inside, and restores it as it was,
    also when the capture raises (a collector the user had turned off stays off)."""
    import gc

    assert gc.isenabled()
    with graphs_module._no_cyclic_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"):
        with graphs_module._no_cyclic_gc():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with graphs_module._no_cyclic_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
