"""Driver for compute-sanitizer (memcheck / racecheck / synccheck): runs every FP8-family kernel once on
small but awkward shapes (tails, misaligned bases, >64 groups with empty members, per-token units of 1)
and checks the bytes against the reference twins. Not a pytest module: run it directly, e.g.
``compute-sanitizer --tool memcheck --kernel-name kns=fp_recipes python tests/sanitize_fp8.py``."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")

from fp_recipes.ops import cuda_fp8 as cu  # noqa: E402
from fp_recipes.ops import ref_fp8, ref_per_token  # noqa: E402


def same(a, b, what):
    if a is None and b is None:
        return
    if a.dtype == torch.float32:  # NaN payloads are not part of the contract
        a, b = torch.nan_to_num(a, nan=0.5), torch.nan_to_num(b, nan=0.5)
    ab = a.contiguous().view(torch.uint8) if a.element_size() == 1 else a.contiguous().reshape(-1).view(torch.uint8)
    bb = b.contiguous().view(torch.uint8) if b.element_size() == 1 else b.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(ab, bb):
        raise SystemExit(f"MISMATCH: {what}")


def main():
    dev = "cuda"
    torch.manual_seed(0)
    s = torch.tensor(0.37, device=dev)
    count = 0
    for dt in (torch.bfloat16, torch.float32):
        for shape in ((1, 1), (67, 131), (128, 8192 + 64)):
            x = (torch.randn(shape, device=dev) * 100).to(dt)
            x.view(-1)[x.numel() // 2] = float("nan") if shape[0] == 67 else 0.0
            for cw in (False, True):
                got = cu.fp8_quantize(x, s, "e4m3", columnwise=cw)
                want = ref_fp8.fp8_quantize(x, s, "e4m3", columnwise=cw)
                for f in ("data", "data_t", "scale_inv", "amax"):
                    same(getattr(got, f), getattr(want, f), f"quantize {dt} {shape} cw={cw} {f}")
                got = cu.fp8_current_scaling_quantize(x, "e5m2", use_power_2_scales=True, columnwise=cw)
                want = ref_fp8.fp8_current_scaling_quantize(x, "e5m2", use_power_2_scales=True, columnwise=cw)
                for f in ("data", "data_t", "scale_inv", "amax", "scale"):
                    same(getattr(got, f), getattr(want, f), f"current {dt} {shape} cw={cw} {f}")
                count += 2
            q = cu.fp8_quantize(x, s, "e4m3")
            same(cu.fp8_dequantize(q.data, q.scale_inv, torch.bfloat16),
                 ref_fp8.fp8_dequantize(q.data, q.scale_inv, torch.bfloat16), "dequant")
            same(cu.fp8_amax(x), ref_fp8.fp8_amax(x), "amax")
            count += 2
    # misaligned base (scalar paths)
    base = torch.randn(5 * 1000 + 1, device=dev).to(torch.bfloat16)
    xm = base[1:].reshape(5, 1000)
    same(cu.fp8_quantize(xm, s, "e4m3", columnwise=True).data_t, ref_fp8.fp8_quantize(xm, s, "e4m3", columnwise=True).data_t,
         "misaligned")
    # grouped: 70 members, some empty, sizes not multiples of anything; then vector-aligned boundaries
    # and members of a few rows of 7168 inside one tile (several boundaries per tile, as in MoE batches)
    for sizes in ([(i * 37) % 1100 if i % 9 else 0 for i in range(70)],
                  [((i * 37) % 23) * 256 if i % 9 else 0 for i in range(70)],
                  [((i * 5) % 7) * 7168 for i in range(40)]):
        count += grouped(sizes, dev)
    # per token
    for fmt, h, bs, dt in (("e5m6", 7168, None, torch.bfloat16), ("e5m6", 264, 24, torch.float32),
                           ("e5m6", 7168, 128, torch.bfloat16), ("e5m6", 8200, None, torch.float16),
                           ("e5m6", 264, 24, torch.bfloat16), ("e5m6", 32768, None, torch.bfloat16),
                           ("e5m6", 8, None, torch.float16),
                           ("e5m6", 2048, 256, torch.bfloat16), ("e5m6", 1024, 8, torch.float16),
                           ("e5m6", 4096, 512, torch.bfloat16),
                           ("e4m3", 1000, 8, torch.bfloat16), ("e4m3", 100, 4, torch.bfloat16),
                           ("e4m3", 1000, 5, torch.float16), ("e4m3", 512, None, torch.float32)):
        x = torch.randn(9, h, device=dev).to(dt)
        x[3] = 0
        x[4, : h // 2] *= 1e-12  # E5M6: values below 2^-14 after scaling take the exact encoder
        x[5, h // 3] = float("nan")
        for rsf, sfmt in ((False, "fp32"), (True, "ue8m0")):
            got = cu.per_token_cast(x, fmt, round_sf=rsf, scale_format=sfmt, block_size=bs)
            want = ref_per_token.per_token_cast(x, fmt, round_sf=rsf, scale_format=sfmt, block_size=bs)
            same(got.data, want.data, f"per-token {fmt} {h} {bs} data")
            same(got.scales, want.scales, f"per-token {fmt} {h} {bs} scales")
            same(cu.cast_back(got.data, got.scales, fmt, scale_format=sfmt, block_size=bs),
                 ref_per_token.cast_back(want.data, want.scales, fmt, scale_format=sfmt, block_size=bs),
                 f"cast_back {fmt} {h} {bs}")
            count += 2
    # E5M6 from a 16-bit input that is not 16-byte aligned (element loads), and an odd row count
    flat = torch.randn(7 * 1024 + 1, device=dev).to(torch.bfloat16)
    xm = flat[1:].reshape(7, 1024)
    got = cu.per_token_cast(xm, "e5m6", round_sf=True, scale_format="ue8m0", block_size=128)
    want = ref_per_token.per_token_cast(xm, "e5m6", round_sf=True, scale_format="ue8m0", block_size=128)
    same(got.data, want.data, "per-token e5m6 misaligned data")
    same(got.scales, want.scales, "per-token e5m6 misaligned scales")
    count += 1
    count += multi(dev)
    count += delayed_update(dev)
    count += bias_grads(dev)
    count += planned_and_from_amax(dev)
    count += fused_activation(dev)
    torch.cuda.synchronize()
    print(f"sanitize_fp8: {count} kernel calls, all bytes equal to the reference")


def fused_activation(dev):
    """The cast of gelu(x) (ops/cuda_fp8_act.py: the amax and tiled passes with the activation prologue) against
    torch's GELU then the plain cast: one row, tails, a misaligned base, 16-bit and FP32 input, both scalings."""
    import torch.nn.functional as F

    from fp_recipes.ops import cuda_fp8_act as act

    count = 0
    flat = (torch.randn(67 * 131 + 1, device=dev) * 4).to(torch.bfloat16)
    inputs = [(torch.randn(1, 1, device=dev) * 3).to(torch.bfloat16), flat[1:].reshape(67, 131).clone(),
              flat[1:].reshape(67, 131), (torch.randn(129, 8192 + 64, device=dev) * 8).to(torch.float16),
              torch.randn(33, 70, device=dev) * 5]
    inputs[1].view(-1)[7] = float("nan")
    for x in inputs:
        a = F.gelu(x, approximate="tanh")
        for rowwise, columnwise in ((True, True), (False, True), (True, False)):
            hist_got, hist_want = torch.zeros((), device=dev), torch.zeros((), device=dev)
            s = torch.tensor(0.37, device=dev)
            got = act.fp8_act_quantize(x, "gelu", "e4m3", rowwise, columnwise, scale=s, record=hist_got)
            want = cu.fp8_quantize_recording(a, s, "e4m3", rowwise, columnwise, hist_want)
            for f in ("data", "data_t", "scale_inv", "amax"):
                same(getattr(got, f), getattr(want, f), f"gelu delayed {tuple(x.shape)} {x.dtype} {f}")
            same(hist_got, hist_want, "gelu delayed record")
            got = act.fp8_act_quantize(x, "gelu", "e5m2", rowwise, columnwise, use_power_2_scales=True)
            want = cu.fp8_current_scaling_quantize(a, "e5m2", use_power_2_scales=True, rowwise=rowwise,
                                                   columnwise=columnwise)
            for f in ("data", "data_t", "scale_inv", "amax", "scale"):
                same(getattr(got, f), getattr(want, f), f"gelu current {tuple(x.shape)} {x.dtype} {f}")
            count += 2
    return count


def planned_and_from_amax(dev):
    """The quantizers' planned casts (FP32 outputs as views of one allocation, the amax in the per-stream
    workspace) and the cast that takes its amax from the graph, against the general wrappers' bytes."""
    count = 0
    for shape in ((1, 16), (65, 64), (257, 1008)):
        x = (torch.randn(shape, device=dev) * 300).to(torch.bfloat16)
        x.view(-1)[x.numel() // 3] = float("nan") if shape[0] == 65 else 0.0
        for rw, cw in ((True, False), (True, True), (False, True)):
            plan = cu.CastPlan("e4m3", rw, cw, True, use_power_2_scales=True, amax_epsilon=1e-12)
            want = cu.fp8_current_scaling_quantize(x, "e4m3", use_power_2_scales=True, amax_epsilon=1e-12,
                                                   rowwise=rw, columnwise=cw)
            got = cu.fp8_cast_planned(x, plan, bias_dtype=torch.bfloat16)
            for i, f in enumerate(("data", "data_t", "scale_inv", "amax", "scale")):
                same(got[i], getattr(want, f), f"planned current {shape} {rw} {cw} {f}")
            scale = torch.tensor(0.8125, device=dev)
            h_want, h_got = torch.full((), 0.25, device=dev), torch.full((), 0.25, device=dev)
            want = cu.fp8_quantize_recording(x, scale, "e5m2", rw, cw, h_want)
            got = cu.fp8_cast_planned(x, cu.CastPlan("e5m2", rw, cw, False), scale, h_got, torch.bfloat16)
            for i, f in enumerate(("data", "data_t", "scale_inv", "amax")):
                same(got[i], getattr(want, f), f"planned delayed {shape} {rw} {cw} {f}")
            same(h_got, h_want, f"planned delayed history {shape}")
            amax = x.abs().amax().float()
            want = cu.fp8_current_scaling_quantize(x, "e5m2", rowwise=rw, columnwise=cw)
            data, data_t, scale_inv, _ = cu.fp8_current_cast_from_amax_op(x, amax, "e5m2", False, 0.0, rw, cw)
            if rw:
                same(data, want.data, f"from_amax {shape} data")
            if cw:
                same(data_t, want.data_t, f"from_amax {shape} data_t")
            same(scale_inv, want.scale_inv, f"from_amax {shape} scale_inv")
            count += 4
    return count


def bias_grads(dev):
    """The bias gradient alone, fused into both casts, and per expert: tails in rows and columns, a
    misaligned base (element loads), every copy combination."""
    count = 0
    flat = torch.randn(130 * 72 + 1, device=dev).to(torch.bfloat16)
    for x in (torch.randn(130, 72, device=dev).to(torch.bfloat16), torch.randn(65, 37, device=dev),
              flat[1:].reshape(130, 72), torch.randn(1, 8, device=dev).to(torch.float16)):
        want = ref_fp8.bias_grad(x, torch.bfloat16)
        same(cu.bias_grad(x, torch.bfloat16), want, "bias_grad")
        s = torch.tensor(0.75, device=dev)
        for rw, cw in ((True, False), (False, True), (True, True)):
            res, db = cu.fp8_quantize_dbias(x, s, "e4m3", rw, cw, None, torch.bfloat16)
            ref = ref_fp8.fp8_quantize(x, s, "e4m3", rowwise=rw, columnwise=cw)
            same(db, want, "fused delayed db")
            same(res.data, ref.data, "fused delayed data")
            same(res.data_t, ref.data_t, "fused delayed data_t")
            res, db = cu.fp8_current_scaling_quantize_dbias(x, "e5m2", False, 0.0, rw, cw, torch.bfloat16)
            ref = ref_fp8.fp8_current_scaling_quantize(x, "e5m2", rowwise=rw, columnwise=cw)
            same(db, want, "fused current db")
            same(res.data, ref.data, "fused current data")
            same(res.data_t, ref.data_t, "fused current data_t")
            count += 2
        count += 1
    dy = torch.randn(17 + 0 + 70, 24, device=dev)
    for g, db in enumerate(cu.bias_grads_rows(dy, [17, 0, 70], [torch.float32] * 3)):
        same(db, ref_fp8.bias_grad(dy.split([17, 0, 70])[g], torch.float32), "grouped bias grads")
    return count + 3


def multi(dev):
    """Multi-tensor casts: >64 members (several launches), empty members, odd rows, both scalings, the
    grouped layer's buffer entry (scale_inv at a 16-byte stride)."""
    n = 0
    for rows in ([(i * 13) % 40 if i % 5 else 0 for i in range(70)], [64, 0, 17, 128]):
        x = (torch.randn(sum(rows), 80, device=dev) * 50).to(torch.bfloat16)
        xs = list(x.split(rows))
        scales = [torch.tensor(0.5 + (i % 3), device=dev) for i in range(len(rows))]
        got = cu.fp8_multi_quantize(xs, scales, "e4m3", rowwise=True, columnwise=True)
        want = ref_fp8.fp8_multi_quantize(xs, scales, "e4m3", rowwise=True, columnwise=True)
        for i in range(len(rows)):
            same(got.data[i], want.data[i], f"multi data {i}")
            same(got.data_t[i], want.data_t[i], f"multi data_t {i}")
        same(got.scale_inv, want.scale_inv, "multi scale_inv")
        same(got.amax, want.amax, "multi amax")
        got = cu.fp8_multi_current_scaling_quantize(xs, "e5m2", rowwise=True, columnwise=True)
        want = ref_fp8.fp8_multi_current_scaling_quantize(xs, "e5m2", rowwise=True, columnwise=True)
        same(got.scale_inv, want.scale_inv, "multi current scale_inv")
        data, data_t, f32, starts, (ld_t, t_starts) = cu.fp8_multi_cast_buffers(xs, "e5m2")
        same(f32[0:4 * len(rows):4], want.scale_inv, "multi buffers scale_inv")
        same(data, torch.cat([d for d in want.data]), "multi buffers data")
        for i, r in enumerate(rows):  # transposed copies: rows zero-padded to 16 (odd members: vector stores)
            block = data_t[t_starts[i]:t_starts[i + 1]].view(80, ld_t[i])
            same(block[:, :r], want.data_t[i], f"multi buffers data_t {i}")
            same(block[:, r:], torch.zeros_like(block[:, r:]), f"multi buffers data_t padding {i}")
        n += 3
    return n


def delayed_update(dev):
    """The one-launch delayed-scaling update over >224 quantizers (several launches) against the rule
    written with torch ops (amax_ref, fmt_max / amax_ref / 2^margin, FLT_MAX clamp, keep the old scale
    unless 0 < amax_ref < inf, roll by -1, zero slot 0)."""
    from fp_recipes.ops import cuda_delayed

    n = 0
    fmax = torch.finfo(torch.float32).max
    for algo in ("max", "most_recent"):
        hists = [torch.rand(16, device=dev) * (i % 7) for i in range(300)]
        scales = [torch.rand((), device=dev) + 0.5 for _ in range(300)]
        want_h, want_s = [], []
        for h, sc in zip(hists, scales):
            amax_ref = h.amax() if algo == "max" else h[0]
            new = torch.div(torch.div(torch.tensor(448.0, device=dev), amax_ref), 2.0).clamp_max(fmax)
            ok = bool(amax_ref > 0) and bool(amax_ref < float("inf"))
            want_s.append(new if ok else sc.clone())
            rolled = torch.roll(h, -1)
            rolled[0] = 0.0
            want_h.append(rolled)
        upd = cuda_delayed.DelayedUpdate.build(hists, scales, 16, hists[0].device)
        if upd is None:
            raise SystemExit("delayed update: the kernel refused the state tensors")
        upd(448.0, 1, algo)
        for i in range(300):
            same(scales[i], want_s[i], f"delayed update scale {algo} {i}")
            same(hists[i], want_h[i], f"delayed update history {algo} {i}")
        n += 1
    return n


def grouped(sizes, dev):
    offs = [0]
    for z in sizes:
        offs.append(offs[-1] + z)
    offsets = torch.tensor(offs, dtype=torch.int64, device=dev)
    xg = torch.randn(offs[-1], device=dev).to(torch.bfloat16)
    scales = torch.rand(len(sizes), device=dev) + 0.5
    got = cu.fp8_grouped_quantize(xg, offsets, scales, "e4m3")
    want = ref_fp8.fp8_grouped_quantize(xg, offsets, scales, "e4m3")
    for f in ("data", "scale_inv", "amax"):
        same(getattr(got, f), getattr(want, f), f"grouped {f}")
    same(cu.fp8_grouped_amax(xg, offsets), ref_fp8.fp8_grouped_amax(xg, offsets), "grouped amax")
    for od in (torch.float32, torch.bfloat16):
        same(cu.fp8_grouped_dequantize(got.data, offsets, got.scale_inv, od),
             ref_fp8.fp8_grouped_dequantize(got.data, offsets, got.scale_inv, od), f"grouped dequant {od}")
    return 4


if __name__ == "__main__":
    main()
