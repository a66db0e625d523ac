"""The demo's outputs: the table printed at the end, the PNG of loss curves and the JSON of every number."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

__all__ = ["format_table", "write_plot", "write_json"]


def format_table(report: Dict[str, Any]) -> str:
    rows: List[Dict[str, Any]] = report["results"]
    head = ["recipe", "train loss*", "val loss", "gap", "tokens/s", "peak MiB", "GEMM path"]
    table = []
    for r in rows:
        gap = "--" if r["gap_pct"] is None else f"{r['gap_pct']:+.2f}%"
        mem = "-" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:,.0f}"
        table.append([r["recipe"], f"{r['train_loss']:.4f}", f"{r['val_loss']:.4f}", gap,
                      f"{r['tokens_per_s']:,.0f}", mem, r["gemm_path"]])
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    lines.append("* train loss: mean of the last min(10, steps) steps; val loss: the held-out set after the "
                 "last step; gap: val loss vs the baseline's; tokens/s: training steps after the first 3 "
                 "(first-use work left out), evaluation excluded.")
    if report.get("model") in _NOISY_SIZES and len(rows) > 1:
        lines.append("gap at this model size: over 300 steps the small model's delayed-scaling gap was -9.5 % on one "
                     "corpus and +5.1 % on another, so read a gap here as noise unless it persists at --model large "
                     "(docs/recipes.md, DelayedScaling)")
    lines.append(f"unigram baseline (byte frequencies, no context): {report['unigram_val_loss']:.4f} nats/byte")
    mem_note = ("peak MiB: torch.cuda.max_memory_allocated per run" if report["device"].startswith("cuda")
                else "peak MiB: the process's peak resident memory during each run")
    lines.append(mem_note)
    env_rows = [r for r in rows if r["env_fields"]]
    for r in env_rows:
        fields = ", ".join(f"{k} <- {v}" for k, v in r["env_fields"].items())
        lines.append(f"from the environment, {r['recipe']}: {fields}")
    if report["device"] == "cpu":
        lines.append("note: on a CPU every quantizer runs its exact pure-torch reference and every quantized "
                     "GEMM is emulated: tokens/s says nothing about GPU speed (`python -m fp_recipes bench` "
                     "measures kernels on a GPU).")
    else:
        base = rows[0]
        faster = [r["recipe"] for r in rows[1:] if r["tokens_per_s"] > base["tokens_per_s"]]
        if faster:
            lines.append(f"faster than the baseline here: {', '.join(faster)}")
        else:
            bigger = _next_size(report.get("model"))
            hint = f"; try --model {bigger}" if bigger else ""
            lines.append("no recipe is faster than the baseline at this model size (the GEMMs are too small "
                         f"for quantization to pay{hint})")
    return "\n".join(lines)


#: demo sizes whose loss gaps to the baseline are within their own spread across corpora (benchmarks/RESULTS.md
#: session 43 run 6: the small model's delayed-scaling gap was -9.5 % on one corpus and +5.1 % on another; tiny's
#: 100 quick steps stayed within 0.3 % on three corpora, large within 1 %)
_NOISY_SIZES = ("small",)


def _next_size(model: Any) -> Any:
    """The next larger demo model size after ``model`` (None if it is the largest or unknown)."""
    from .model import SIZES

    names = list(SIZES)
    return names[names.index(model) + 1] if model in names[:-1] else None


def write_plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in report["results"]:
        curve = r["train_curve"]
        window = max(1, len(curve) // 25)
        smooth = [sum(curve[max(0, i - window + 1): i + 1]) / len(curve[max(0, i - window + 1): i + 1])
                  for i in range(len(curve))]
        ax_train.plot(range(1, len(curve) + 1), smooth, label=r["recipe"])
        steps = [s for s, _ in r["val_curve"]]
        ax_val.plot(steps, [v for _, v in r["val_curve"]], marker="o", markersize=3, label=r["recipe"])
    for ax in (ax_train, ax_val):
        ax.axhline(report["unigram_val_loss"], color="grey", linestyle=":", label="unigram baseline")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_train.set_title(f"train loss (moving mean of {max(1, report['steps'] // 25)} steps)")
    ax_val.set_title("validation loss (held-out)")
    fig.suptitle(f"fp_recipes demo: model {report['model']}, {report['steps']} steps, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(report: Dict[str, Any], path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(tmp, path)
