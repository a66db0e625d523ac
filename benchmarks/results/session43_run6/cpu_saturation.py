"""Fraction of elements a delayed-scaling cast saturates (|x| * scale > fmt_max) or flushes to zero, per tensor kind,
over the demo's small model on the CPU (reference kernels)."""
import sys, collections, torch
import fp_recipes
from fp_recipes.quantizers.float8 import Float8Quantizer
from fp_recipes.demo import model as dm, data as dd, train as dt

stats = collections.defaultdict(lambda: [0, 0, 0, 0])  # kind -> [elements, saturated, zero-flushed nonzero, calls]
orig_q, orig_b = Float8Quantizer._quantize, Float8Quantizer.quantize_with_bias_grad
def tally(self, x):
    s = float(self.scale)
    a = x.detach().float().abs() * s
    kind = self.spec.role.tensor.value
    st = stats[kind]
    st[0] += a.numel(); st[1] += int((a > self.fmt_max).sum()); st[3] += 1
    tiny = 2.0 ** (-9 if self.fmt == "e4m3" else -16)
    st[2] += int(((a < tiny / 2) & (a > 0)).sum())
def q(self, x, r, c):
    tally(self, x); return orig_q(self, x, r, c)
def qb(self, x, bd):
    tally(self, x); return orig_b(self, x, bd)
Float8Quantizer._quantize = q
Float8Quantizer.quantize_with_bias_grad = qb
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60


from fp_recipes.demo import cli
cli.run_demo(["--model", "small", "--steps", str(steps), "--recipes", "delayed", "--batch", "16", "--no-plot", "--no-progress",
              "--device", "cpu", "--dtype", "bfloat16", "--out", "/tmp/sat_out"])
for kind, (n, sat, flush, calls) in stats.items():
    print(f"{kind:12s} calls {calls:6d}  saturated {sat / n:.2e}  flushed-to-zero {flush / n:.2e}")
