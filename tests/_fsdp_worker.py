"""One rank of the FSDP2 tests (launched by tests/test_fsdp.py with torch.distributed.run, gloo).

For each recipe it trains six copies of the same small model on rank-dependent data:
``plain`` (no FSDP, one rank's data), ``fsdp`` (fully_shard, ordinary all-gather), ``qag``
(fully_shard with the quantized all-gather), ``qag_pre`` (the same with the weights' amaxes precomputed in one
all-reduce before step 0 and after step 0's optimizer step, but not after step 1's: step 2's gathers find their
weights changed and reduce their own), and ``fsdp_ckpt``/``qag_ckpt`` (fsdp and qag with every block under
activation checkpointing; qag_ckpt precomputes its amaxes after every optimizer step), and writes what the test checks to a JSON file per rank.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import fp_recipes
from fp_recipes.integrations.fsdp import all_gather_bytes, enable_quantized_all_gather, precompute_weight_amaxes

RECIPES = {
    "delayed": lambda: fp_recipes.DelayedScaling(amax_history_len=4),
    # no amax all-reduce: the weight's history must still hold the whole weight's amax (not the shard's)
    "delayed_no_reduce": lambda: fp_recipes.DelayedScaling(amax_history_len=4, reduce_amax=False),
    "current": lambda: fp_recipes.Float8CurrentScaling(),
    "nvfp4": lambda: fp_recipes.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "nvfp4_1d_4over6": lambda: fp_recipes.NVFP4BlockScaling(disable_2d_quantization=True, disable_stochastic_rounding=True,
                                                            nvfp4_4over6="weights"),
}
STEPS = 3
ROOT = Path(__file__).resolve().parent.parent


def _descendants(pid: int) -> list:
    """Every live descendant of ``pid`` (from /proc): torchrun starts its workers in new sessions,
    so killing torchrun's process group would leave them running."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def torchrun(script: Path, args, env_extra: dict, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 script *args`` with a clean
    NVTE_*/FP_RECIPES_* environment. ``--standalone`` gives the rendezvous a free port (with the static
    rendezvous, ``--master-port 0`` hands the workers port 0 and they wait for the store forever).
    A run past ``timeout`` seconds is stopped, its workers included, and the test fails with the output
    so far: a hang costs ``timeout``, never a stuck CI job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "FP_RECIPES_"))}
    env.update(env_extra, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        for pid in [proc.pid] + workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        raise AssertionError(f"{script.name} {' '.join(map(str, args))}: no result after {timeout:.0f} s "
                             f"(hung?); stopped.\n{out[-2000:]}\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Block(torch.nn.Module):
    """``ckpt``: the block runs under activation checkpointing (non-reentrant, as FSDP2 recommends):
    the recomputation in the backward all-gathers the weights again and must quantize them as the
    forward did."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.ln_fc1 = fp_recipes.LayerNormLinear(64, 128)
        self.fc2 = fp_recipes.Linear(128, 64)
        self.ckpt = ckpt

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        # FC2 applies the GELU to its input (LayerNormMLP's path: Linear.forward_activation), exactly F.gelu then FC2
        return x + self.fc2.forward_activation(self.ln_fc1(x), "gelu_erf")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


def build(ckpt: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(ckpt), Block(ckpt), fp_recipes.Linear(64, 32))


def shard(model: torch.nn.Module) -> None:
    for m in model:
        fully_shard(m)
    fully_shard(model)


def state_of(model: torch.nn.Module) -> dict:
    """Delayed-scaling buffers (amax history, scale) of every module, as lists."""
    out = {}
    for name, buf in model.named_buffers():
        if "qstate_" in name:
            out[name] = buf.flatten().tolist()
    return out


def full_params(model: torch.nn.Module) -> dict:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        inner = getattr(t, "_inner", t)
        out[name.replace("_fsdp_wrapped_module.", "")] = inner.detach().flatten().tolist()
    return out


def main() -> None:
    out_prefix = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a hung collective fails
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {}
    for name, make in RECIPES.items():
        recipe = make()
        models = {"plain": build(), "fsdp": build(), "qag": build(), "qag_pre": build(),
                  "fsdp_ckpt": build(ckpt=True), "qag_ckpt": build(ckpt=True)}
        converted = enable_quantized_all_gather(models["qag"], recipe)
        enable_quantized_all_gather(models["qag_pre"], recipe)
        enable_quantized_all_gather(models["qag_ckpt"], recipe)
        for k in ("fsdp", "qag", "qag_pre", "fsdp_ckpt", "qag_ckpt"):
            shard(models[k])
        precomputed = [precompute_weight_amaxes(models["qag_pre"])]
        precompute_weight_amaxes(models["qag_ckpt"])  # and under activation checkpointing (the recompute's gathers)
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
        rec: dict = {"converted": converted, "losses": {k: [] for k in models}, "outputs_equal_plain_step0": None}
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(32, 64, generator=g) * (1 + rank)  # ranks see different data
            if step % 2:
                x = x.reshape(4, 8, 64)  # 3-D (batch, sequence, features), as transformers models call
            outs = {}
            for k, m in models.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with fp_recipes.autocast(recipe=recipe):
                        y = m(x)
                # FSDP2 warns when a sharded module returns a view (an in-place op on it would drop
                # the pre-backward hook): fp_recipes modules must not
                views = [str(w.message)[:120] for w in caught if "view tensor" in str(w.message)]
                rec.setdefault("view_warnings", []).extend(views)
                outs[k] = y
                loss = y.float().square().mean()
                loss.backward()
                rec["losses"][k].append(loss.item())
                opts[k].step()
                opts[k].zero_grad()
                if k == "qag_pre" and step == 0:
                    precomputed.append(precompute_weight_amaxes(m))
                if k == "qag_ckpt":
                    precompute_weight_amaxes(m)
            if step == 0:
                rec["outputs_equal_plain_step0"] = torch.equal(outs["qag"], outs["plain"])
            rec.setdefault("outputs_equal_fsdp", []).append(torch.equal(outs["qag"], outs["fsdp"]))
            rec.setdefault("precomputed_outputs_equal", []).append(torch.equal(outs["qag_pre"], outs["qag"]))
            rec.setdefault("ckpt_outputs_equal", []).append(
                torch.equal(outs["fsdp_ckpt"], outs["fsdp"]) and torch.equal(outs["qag_ckpt"], outs["qag"]))
        for k in ("fsdp", "qag", "qag_pre", "fsdp_ckpt", "qag_ckpt"):
            rec[f"params_{k}"] = full_params(models[k])
            rec[f"state_{k}"] = state_of(models[k])
        rec["precomputed"] = precomputed
        rec["amax_gathers"] = {k: [[m._fp_recipes_all_gather_owner.stats.amax_reduces,
                                    m._fp_recipes_all_gather_owner.stats.amax_precomputed]
                                   for m in models[k].modules() if hasattr(m, "_fp_recipes_all_gather_owner")]
                               for k in ("qag", "qag_pre", "qag_ckpt")}
        rec["bytes"] = {k: list(v) for k, v in all_gather_bytes(models["qag"]).items()}
        result[name] = rec
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
