"""TP=2 and TP=2 + sequence parallel on the fp_recipes Megatron backend, and distributed
checkpoints resharded between TP=2 and TP=1: 2 real gloo processes (torchrun), one launch each."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_tp2_and_sequence_parallel_match_tp1(tmp_path):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "_megatron_tp_worker.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    ref = res["tp1"]["losses"]
    for name in ("tp1", "tp2", "tp2_sp"):
        assert res[name]["state_identical_on_ranks"], name  # delayed scales equal on both ranks
    for name in ("tp2", "tp2_sp"):
        # TP splits the row-parallel GEMMs' reduction (FP32 partial sums added by all-reduce), so
        # losses match TP=1 to FP32 rounding; the FP8 scales are identical (amax reduced over TP+DP).
        assert all(abs(a - b) < 1e-4 for a, b in zip(ref, res[name]["losses"])), (name, ref, res[name])


@pytest.mark.slow
def test_dist_checkpoint_resharding_tp2_to_tp1_and_back(tmp_path):
    """Issue 17 item 3 on gloo: saved at TP=2 (+SP), loaded at TP=1; saved at TP=1, loaded at TP=2."""
    out = tmp_path / "ckpt.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "_megatron_ckpt_worker.py"), str(out), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    for res in ranks:
        for direction in ("tp2_to_tp1", "tp1_to_tp2"):
            # the loaded model holds exactly the saved weights (TP shards gathered/sliced by Megatron)
            # and exactly the saved delayed-scaling state
            assert res[f"{direction}_weights_differ"] == [], (direction, res)
            assert res[f"{direction}_state_differs"] == [], (direction, res)
        # Resumed at the other TP size, the losses follow the uninterrupted run to FP32 rounding
        # (TP changes how the row-parallel GEMMs' partial sums are added; scales are identical).
        for resumed, ref in (("tp1_resumed", "tp2_uninterrupted"), ("tp2_resumed", "tp1_uninterrupted")):
            assert len(res[resumed]) == len(res[ref])
            assert all(abs(a - b) < 1e-4 for a, b in zip(res[resumed], res[ref])), (resumed, res)
    assert ranks[0] == ranks[1]  # every rank saw the same losses and loaded the same state
