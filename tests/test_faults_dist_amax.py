"""Delayed-scaling amax reduction across real processes (gloo, CPU): ranks see different data; after every
step each rank's amax histories and scales are bitwise those of ONE process that ran every rank's batch
in the same step (a module called several times in a step records the max of its calls, which is
exactly what the MAX all-reduce computes), with the default group (no ``amax_reduction_group``: the
world, as TransformerEngine does), an explicit group and subgroups; one all-reduce per forward and one
per backward; ``reduce_amax=False`` opts out."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp_recipes
from fp_recipes import DelayedScaling, GroupedLinear, Linear
from fp_recipes.modules import amax_reduction

STEPS = 3


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Linear(16, 24)
        self.b = Linear(24, 8)
        self.g = GroupedLinear(2, 8, 8)

    def forward(self, x):
        return self.g(self.b(torch.relu(self.a(x))), [4, x.shape[0] - 4])


def _data(step: int, rank: int):
    """Rank r's batch: its own values and magnitude (the max of each tensor comes from different ranks
    at different steps)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    scale = 2.0 ** ((rank * 3 + step * 5) % 7)
    return torch.randn(10, 16, generator=g) * scale, torch.randn(10, 8, generator=g) * (rank + 1)


def _state(model) -> torch.Tensor:
    """Every amax history and scale, as one int32 vector (bit patterns)."""
    parts = [v.reshape(-1) for k, v in model.state_dict().items() if "qstate_" in k]
    return torch.cat(parts).view(torch.int32)


def _check_mode(rank: int, world: int, mode: str, device: str = "cpu") -> None:
    if mode == "subgroups":  # every rank creates every group, in the same order
        halves = [list(range(0, world // 2)), list(range(world // 2, world))]
        groups = [dist.new_group(h) for h in halves]
        members = halves[0] if rank in halves[0] else halves[1]
        group = groups[0] if rank in halves[0] else groups[1]
    elif mode == "explicit":
        members, group = list(range(world)), dist.new_group(list(range(world)))
    else:  # "default", "opt_out": no group given
        members, group = list(range(world)), None
    torch.manual_seed(0)
    model = _Net().to(device)
    reference = copy.deepcopy(model)
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=mode != "opt_out")
    ref_recipe = DelayedScaling(amax_history_len=4, reduce_amax=False)  # one process: nothing to reduce
    before = amax_reduction.all_reduce_count()
    for step in range(STEPS):
        x, t = (v.to(device) for v in _data(step, rank))
        with fp_recipes.autocast(recipe=recipe, amax_reduction_group=group):
            y = model(x)
        (y * t).sum().backward()
        # the single-process reference of this rank's group: every member's batch in the same step
        batches = [tuple(v.to(device) for v in _data(step, r)) for r in members] if mode != "opt_out" \
            else [(x, t)]
        with fp_recipes.autocast(recipe=ref_recipe):
            ys = [reference(bx) for bx, _ in batches]
        sum((by * bt).sum() for by, (_, bt) in zip(ys, batches)).backward()
        mine, ref = _state(model), _state(reference)
        assert torch.equal(mine, ref), f"{mode}: rank {rank} differs from the one-process run at step {step}"
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        same = [torch.equal(gathered[r], mine) for r in range(world)]
        if mode == "opt_out":
            assert not all(same), "reduce_amax=False: ranks with different data must keep their own scales"
        else:
            assert all(same[r] for r in members), f"{mode}: ranks {members} differ at step {step}"
    count = amax_reduction.all_reduce_count() - before
    assert count == (0 if mode == "opt_out" else 2 * STEPS), f"{mode}: {count} all-reduces in {STEPS} steps"


def _worker(rank: int, world: int, port: int, modes: list, backend: str = "gloo") -> None:
    os.environ.pop("FP_RECIPES_RECIPE", None)
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":  # one GPU per rank; the amaxes and the all-reduce stay on the GPU
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for mode in modes:
            _check_mode(rank, world, mode, device)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,modes", [
    (2, ["default", "explicit", "opt_out"]),
    pytest.param(4, ["default", "subgroups"], marks=pytest.mark.slow),  # ~8 s idle, 4 processes on 2 cores
])
def test_ranks_equal_one_process_that_saw_all_data(world, modes):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(world, _free_port(), modes), nprocs=world, join=True)


@pytest.mark.cuda
def test_ranks_equal_one_process_that_saw_all_data_nccl():
    """Issue 17 item 2: the same check over NCCL, one GPU per rank (the CUDA cast and delayed-update
    kernels, amaxes reduced on the GPU): bitwise equal to one process on the same GPU kind."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA GPUs and NCCL")
    mp.spawn(_worker, args=(2, _free_port(), ["default", "explicit", "opt_out"], "nccl"), nprocs=2, join=True)


def test_default_group_rules(monkeypatch):
    """Which group the default reduces over, without processes: not initialised -> none; a world of one
    rank -> none (identity); more ranks -> the world (None to torch.distributed); explicit -> as given."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert amax_reduction.reduction_group(None) is amax_reduction.NO_REDUCTION
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert amax_reduction.reduction_group(None) is amax_reduction.NO_REDUCTION
    marker = object()
    assert amax_reduction.reduction_group(marker) is marker
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    assert amax_reduction.reduction_group(None) is None
