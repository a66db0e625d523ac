"""A backward that raises must cost one step, never the run: autograd does not run the end-of-backward
callback of a pass that raised, so the delayed-scaling reducer must not wait for it forever, and the
partial amax records of the failed pass must not leak into the next pass."""

from __future__ import annotations

import pytest
import torch

import fp_recipes
from fp_recipes import DelayedScaling, GroupedLinear, Linear


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Linear(16, 32)
        self.b = Linear(32, 16)
        self.g = GroupedLinear(2, 16, 8)

    def forward(self, x):
        return self.g(self.b(torch.relu(self.a(x))), [5, x.shape[0] - 5])


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(12, 16, generator=g) * 3.0 ** step  # growing data: every scale keeps moving
    t = torch.randn(12, 8, generator=g) * 2.0 ** step
    return x, t


def _poison(t: torch.Tensor) -> torch.Tensor:
    """+Inf and -Inf in one column of the first expert's targets: dy stays NaN-free through the loss
    (anomaly mode passes it), the expert's grad_output quantizer records an Inf amax, and its bias
    gradient (the column sum, Inf - Inf) is NaN, so anomaly mode raises inside our backward, after the
    record and the queued end-of-backward update."""
    t = t.clone()
    t[0, 2] = float("inf")
    t[1, 2] = float("-inf")
    return t


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if "qstate_" in k}


def _grad_output_scales(model) -> list:
    return [v.item() for k, v in model.state_dict().items() if "grad_output" in k and k.endswith("_scale")]


def _run(bad_step: int, steps: int, fail: bool):
    """Steps without an optimizer (weights fixed, data growing). At ``bad_step`` the targets are
    poisoned (:func:`_poison`): anomaly mode raises inside the backward. ``fail=False`` is the control: that step runs its
    forward only (what a loop that skips the bad batch's backward does)."""
    torch.manual_seed(0)
    model = _Net()
    recipe = DelayedScaling(amax_history_len=16)
    states, grads, scales = [], [], []
    for step in range(steps):
        x, t = _batch(step)
        if step == bad_step:
            t = _poison(t)
        with fp_recipes.autocast(recipe=recipe):
            y = model(x)
        loss = (y * t).sum()
        model.zero_grad(set_to_none=True)
        if step == bad_step:
            if fail:
                with pytest.raises(RuntimeError, match="nan"):
                    with torch.autograd.detect_anomaly():
                        loss.backward()
            continue
        loss.backward()
        states.append(_state(model))
        grads.append([p.grad.clone() for p in model.parameters()])
        scales.append(_grad_output_scales(model))
    return states, grads, scales


def test_failed_backward_leaves_the_state_as_if_it_had_not_run():
    """After the raising backward, later backwards update every grad_output scale again, and the whole
    delayed-scaling state (every history slot and scale, forward and backward) and every gradient are
    bitwise those of the run whose bad step ran its forward only: the failed pass's partial amax records
    (Inf here) are dropped, not carried into the next pass."""
    bad = 2
    states, grads, scales = _run(bad, 7, fail=True)
    c_states, c_grads, c_scales = _run(bad, 7, fail=False)
    after = scales[bad:]  # the steps after the bad one
    for prev, cur in zip(after, after[1:]):
        assert all(a != b for a, b in zip(prev, cur)), f"a grad_output scale stopped moving: {prev} -> {cur}"
    for i, (s, c) in enumerate(zip(states, c_states)):
        for k in c:
            assert torch.equal(s[k].view(torch.int32), c[k].view(torch.int32)), (i, k, s[k], c[k])
    for g, c in zip(grads, c_grads):
        for a, b in zip(g, c):
            assert torch.equal(a, b)


def test_two_failed_backwards_in_a_row_then_recovery():
    """Two raising passes one after the other (the second finds the first's stale records and state):
    the following good steps still equal the control."""
    torch.manual_seed(0)
    model = _Net()
    torch.manual_seed(0)
    control = _Net()
    recipe = DelayedScaling(amax_history_len=16)
    for step in range(6):
        x, t = _batch(step)
        for m in (model, control):
            with fp_recipes.autocast(recipe=recipe):
                y = m(x)
            if step in (1, 2):
                if m is model:
                    bad_t = _poison(t)
                    with pytest.raises(RuntimeError, match="nan"):
                        with torch.autograd.detect_anomaly():
                            (y * bad_t).sum().backward()
                continue
            (y * t).sum().backward()
        ref = _state(control)
        got = _state(model)
        for k in ref:
            assert torch.equal(got[k].view(torch.int32), ref[k].view(torch.int32)), (step, k)
