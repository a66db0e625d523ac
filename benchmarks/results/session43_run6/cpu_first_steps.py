import collections, torch
from fp_recipes.quantizers.float8 import Float8Quantizer
from fp_recipes.demo import cli
log = []
orig_q, orig_b = Float8Quantizer._quantize, Float8Quantizer.quantize_with_bias_grad
def tally(self, x):
    a = x.detach().float().abs() * float(self.scale)
    tiny = 2.0 ** (-9 if self.fmt == "e4m3" else -16)
    nz = (x != 0).sum().item()
    log.append((self.spec.role.tensor.value, float(self.scale), ((a < tiny / 2) & (a > 0)).sum().item() / max(nz, 1)))
def q(self, x, r, c):
    tally(self, x); return orig_q(self, x, r, c)
def qb(self, x, bd):
    tally(self, x); return orig_b(self, x, bd)
Float8Quantizer._quantize = q; Float8Quantizer.quantize_with_bias_grad = qb
cli.run_demo(["--model", "small", "--steps", "3", "--recipes", "delayed", "--batch", "16", "--no-plot", "--no-progress",
              "--device", "cpu", "--dtype", "bfloat16", "--out", "/tmp/sat0_out", "--eval-every", "1000"])
per = len(log) // 3
for step in range(3):
    chunk = log[step * per:(step + 1) * per]
    by = collections.defaultdict(list)
    for kind, s, f in chunk: by[kind].append((s, f))
    print("step", step, {k: (round(sum(f for _, f in v) / len(v), 4), round(min(s for s, _ in v), 1)) for k, v in by.items()})
