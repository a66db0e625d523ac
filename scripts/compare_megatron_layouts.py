"""Compare examples/megatron_gpt.py runs of several parallel layouts (the JSONs its rank 0 writes):
per recipe, each layout's final and validation loss, how far its loss curve is from the first
layout's (TP=1; recipes matched by name, so the first may be a one-GPU run of fewer recipes), tokens/s
per GPU, and whether the delayed-scaling state was identical on every rank after every step. Prints a
markdown table (final loss difference signed: negative = lower than the first) and writes the JSON.

    python scripts/compare_megatron_layouts.py OUT.json tp1_dp2.json tp2.json tp2_sp.json

Tolerance: the layouts add the same partial sums in different orders (TP splits the row-parallel
GEMMs' reductions, DP averages BF16 gradients), so BF16 training drifts apart step by step like two
seeds of one run; what must hold is the same curve: final losses (mean of the last 10 % of steps)
within TOL_FINAL of each other, and the mean absolute per-step difference under TOL_CURVE."""

from __future__ import annotations

import json
import sys
from typing import Dict, List

TOL_FINAL = 0.03   # relative, final training loss
TOL_CURVE = 0.03   # relative, mean |loss_layout - loss_tp1| / mean loss_tp1 over all steps


def layout_name(run: dict) -> str:
    return f"TP={run['tp']}{'+SP' if run['sp'] else ''} DP={run['dp']}"


def main(argv: List[str]) -> int:
    out, paths = argv[0], argv[1:]
    runs = [json.load(open(p)) for p in paths]
    ref = runs[0]
    rows: List[Dict] = []
    ok = True
    print(f"device: {ref['device']} x {ref['world_size']}, megatron-core {ref['megatron_core']}, "
          f"{ref['steps']} steps, model {ref['model']}")
    print("| recipe | layout | final loss | val loss | mean abs d(loss) vs first | final vs first | "
          "tokens/s/GPU | state identical on ranks |")
    print("|---|---|---|---|---|---|---|---|")
    for r0 in ref["results"]:
        for run in runs:
            by_name = {r["recipe"]: r for r in run["results"]}
            if r0["recipe"] not in by_name:
                print(f"| {r0['recipe']} | {layout_name(run)} | not run in this layout | | | | | |")
                continue
            r = by_name[r0["recipe"]]
            curve = sum(abs(a - b) for a, b in zip(r["losses"], r0["losses"])) / len(r0["losses"])
            curve_rel = curve / (sum(r0["losses"]) / len(r0["losses"]))
            final_signed = (r["final_loss"] - r0["final_loss"]) / r0["final_loss"]
            final_rel = abs(final_signed)
            same_state = not r["state_differs_at_steps"]
            good = curve_rel <= TOL_CURVE and final_rel <= TOL_FINAL and same_state
            ok &= good
            rows.append({"recipe": r["recipe"], "layout": layout_name(run), "final_loss": r["final_loss"],
                         "val_loss": r["val_loss"], "curve_mean_abs_diff": curve, "curve_rel": curve_rel,
                         "final_rel": final_rel, "final_signed": final_signed, "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                         "state_identical": same_state, "within_tolerance": good})
            print(f"| {r['recipe']} | {layout_name(run)} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | "
                  f"{curve:.4f} ({100 * curve_rel:.2f} %) | {100 * final_signed:+.2f} % | "
                  f"{r['tokens_per_s_per_gpu']:,.0f} | {'yes' if same_state else 'NO'} |")
    print(f"tolerance: final loss within {100 * TOL_FINAL:.0f} %, mean per-step difference within "
          f"{100 * TOL_CURVE:.0f} %, state identical: {'all met' if ok else 'NOT MET'}")
    json.dump({"runs": paths, "tolerance": {"final_rel": TOL_FINAL, "curve_rel": TOL_CURVE},
               "rows": rows, "all_within_tolerance": ok}, open(out, "w"), indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
