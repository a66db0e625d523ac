"""One rank of the torch.compile + FSDP2 test (tests/test_compile_fsdp.py; torch.distributed.run, gloo).

For each recipe it trains two copies of the model of tests/_fsdp_worker.py, both sharded with real
``fully_shard``: one eagerly, one under ``torch.compile`` (backend ``aot_eager``: the captured graphs
run their ATen ops as they are, so the two must agree to the bit), on rank-dependent data, and writes
what the test checks to a JSON file per rank. Modes:

* ``outside``: ``torch.compile(model)``, ``fp_recipes.autocast`` around the call;
* ``inside``: the compiled function enters the autocast itself (its exit, the amax all-reduce over
  the world group included, is traced);
* ``qag_outside``: as ``outside`` with the quantized all-gather (those weights' GEMMs run eagerly
  under torch.compile: see docs/modules.md).
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

import fp_recipes
from _fsdp_worker import RECIPES, STEPS, build, full_params, shard, state_of
from fp_recipes.integrations.fsdp import enable_quantized_all_gather

MODES = ("outside", "inside", "qag_outside")
QAG_RECIPES = ("delayed", "nvfp4")
# with the default NVFP4 recipe's stochastic rounding of gradients too: under torch.compile each SR cast is one op
# reading the quantizer's seed and counter when it runs (quantizers/nvfp4.py traced_sr_as_op)
COMPILE_RECIPES = {**RECIPES, "nvfp4_sr": lambda: fp_recipes.NVFP4BlockScaling()}


def run(name: str, mode: str, rank: int) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recipe = COMPILE_RECIPES[name]()
    eager, model = build(), build()
    if mode.startswith("qag"):
        enable_quantized_all_gather(eager, recipe)
        enable_quantized_all_gather(model, recipe)
    shard(eager)
    shard(model)
    if mode == "inside":
        def step(x):
            with fp_recipes.autocast(recipe=recipe):
                return model(x)
        compiled = torch.compile(step, backend="aot_eager")
    else:
        compiled = torch.compile(model, backend="aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, model)]
    rec: dict = {"outputs_equal": [], "losses": [[], []]}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g) * (1 + rank)  # ranks see different data
        outs = []
        for i, (fn, opt) in enumerate(((eager, opts[0]), (compiled, opts[1]))):
            if fn is compiled and mode == "inside":
                y = fn(x)
            else:
                with fp_recipes.autocast(recipe=recipe):
                    y = fn(x)
            loss = y.float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
            rec["losses"][i].append(loss.item())
        rec["outputs_equal"].append(torch.equal(outs[0], outs[1]))
    rec["params_equal"] = full_params(eager) == full_params(model)
    rec["state_equal"] = state_of(eager) == state_of(model)
    rec["state"] = state_of(model)
    rec["state_nonempty"] = bool(rec["state"]) or not name.startswith("delayed")
    rec["graphs"] = counters["stats"]["unique_graphs"]
    rec["graph_breaks"] = [str(k)[:400] for k in counters["graph_break"]]
    return rec


def main() -> None:
    out_prefix = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a hung collective fails
    rank = dist.get_rank()
    result: dict = {}
    for name in COMPILE_RECIPES:
        for mode in MODES:
            if mode.startswith("qag") and name not in QAG_RECIPES:
                continue
            result[f"{name}/{mode}"] = run(name, mode, rank)
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
