"""One training run per recipe, from identical weights and batches.

Every run rebuilds the model from the same seed, so weight init is bit-identical, and takes its
batches from the same precomputed start positions: the loss gap to the baseline is the recipe's
numerics alone. Train loss is logged every step, validation loss on a fixed held-out set every
``eval_every`` steps and at the end.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from .data import Corpus
from .model import GPT, ModelConfig

__all__ = ["RunResult", "train_one", "peak_memory_reset", "peak_memory_bytes"]

AUX_LOSS_WEIGHT = 0.01  # Switch Transformer's load-balancing weight


@dataclass
class RunResult:
    recipe: str
    description: str
    train_loss: float  # mean of the last min(10, steps) steps
    val_loss: float  # held-out set, after the last step
    gap_pct: Optional[float]  # val loss vs the baseline's, in %
    tokens_per_s: float
    peak_memory_mib: Optional[float]
    gemm_path: str
    env_fields: Dict[str, str]  # field -> "env NAME=value" for the fields the environment set
    config: Optional[Dict[str, Any]]
    train_curve: List[float] = field(default_factory=list)
    val_curve: List[List[float]] = field(default_factory=list)  # [step, loss]
    seconds: float = 0.0


def peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets the process's peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """Peak CUDA memory allocated, or the process's peak resident set on CPU (Linux), else None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@torch.no_grad()
def evaluate(model: GPT, corpus: Corpus, starts: torch.Tensor, cfg: ModelConfig, device: torch.device,
             recipe: Any) -> float:
    import fp_recipes

    model.eval()
    total, count = 0.0, 0
    for chunk in starts.split(cfg.batch):
        x, y = corpus.batch(chunk, cfg.seq_len, split="val")
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            logits, _ = model(x.to(device))
        total += float(F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum"))
        count += y.numel()
    model.train()
    return total / count


def _lr(step: int, steps: int, base: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


def untimed_steps(steps: int) -> int:
    """Steps left out of tokens/s: the first ones pay one-time costs (GEMM plans, allocator growth)."""
    return min(3, steps - 1)


def train_one(name: str, description: str, recipe: Any, cfg: ModelConfig, corpus: Corpus, steps: int,
              seed: int, device: torch.device, dtype: torch.dtype, batch_starts: torch.Tensor,
              val_starts: torch.Tensor, eval_every: int, gemm_path: str, progress: bool) -> RunResult:
    import fp_recipes

    torch.manual_seed(seed)
    model = GPT(cfg, device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    tokens_per_step = cfg.batch * cfg.seq_len
    bar = _progress_bar(steps, name, progress)
    train_curve: List[float] = []
    val_curve: List[List[float]] = []
    peak_memory_reset(device)
    busy = 0.0  # seconds in forward/backward/step, evaluation excluded
    untimed = untimed_steps(steps)  # first-use work (plans, tables, allocator growth) is not throughput
    t_start = time.perf_counter()
    for step in range(steps):
        x, y = corpus.batch(batch_starts[step], cfg.seq_len)
        x, y = x.to(device), y.to(device)
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, cfg.lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with fp_recipes.autocast(enabled=recipe is not None, recipe=recipe):
            logits, aux = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        (loss + AUX_LOSS_WEIGHT * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()  # synchronises
        if step >= untimed:
            busy += time.perf_counter() - t0
        train_curve.append(value)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            val_curve.append([step + 1, evaluate(model, corpus, val_starts, cfg, device, recipe)])
        if bar is not None:
            post = {"loss": f"{value:.3f}"}
            if busy > 0:
                post["tok/s"] = f"{tokens_per_step * (step + 1 - untimed) / busy:,.0f}"
            if val_curve:
                post["val"] = f"{val_curve[-1][1]:.3f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    if not all(math.isfinite(v) for v in train_curve):
        bad = next(i for i, v in enumerate(train_curve) if not math.isfinite(v))
        raise FloatingPointError(f"recipe {name}: the training loss became {train_curve[bad]} at step {bad + 1}")
    peak = peak_memory_bytes(device)
    tail = train_curve[-min(10, steps):]
    config = recipe.to_config() if recipe is not None else None
    env_fields = ({k: v for k, v in recipe.provenance().items() if v.startswith("env")}
                  if recipe is not None else {})
    return RunResult(
        recipe=name, description=description, train_loss=sum(tail) / len(tail), val_loss=val_curve[-1][1],
        gap_pct=None, tokens_per_s=tokens_per_step * (steps - untimed) / busy,
        peak_memory_mib=None if peak is None else peak / 2**20, gemm_path=gemm_path, env_fields=env_fields,
        config=config, train_curve=train_curve, val_curve=val_curve,
        seconds=time.perf_counter() - t_start)


def _progress_bar(steps: int, name: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc=f"{name:<16}", unit="step", dynamic_ncols=True, leave=True)
