"""How a delayed-scaling update hands its launches to the torch-linked host path (``_torch_ops.DelayedUpdates``,
FP_RECIPES_TORCH_OPS) on any machine: the batch tuples it is built from (pointer table, sizes, the recipe's
numbers, the mapped flags), and when the Python reports still run after the C++ call (a flag set, flags on the
device, a capture counting eager reports; never when the flags were read clear). The C++ call itself against the
Python launches: tests/test_cuda_fast_ops.py (GPU)."""

from __future__ import annotations

import torch

from fp_recipes import _extension
from fp_recipes.modules import amax_reduction
from fp_recipes.ops.cuda_delayed import DelayedUpdate
from fp_recipes.quantizers import nonfinite
from fp_recipes.quantizers.nonfinite import NonfiniteWatch


class _Fast:
    """Stands in for fp_recipes._torch_ops: records what DelayedUpdates is built from; run() answers ``result``."""

    def __init__(self, result):
        self.built = []
        self.result = result
        self.runs = 0
        fast = self

        class DelayedUpdates:
            def __init__(self, device, batches, scales):
                fast.built.append((device, batches, scales))

            def run(self):
                fast.runs += 1
                return fast.result

        self.DelayedUpdates = DelayedUpdates


class _Watch(NonfiniteWatch):
    def __init__(self, count, mapped):
        super().__init__(count, torch.device("cpu"))
        self._mapped = mapped
        self.reports = 0

    def report(self, quantizers):
        self.reports += 1


def _steps(mapped=(4096, 8192, bytes(2))):
    """One batch of two quantizers' state: (update, its launch arguments, watch, quantizers), the scales."""
    hist = [torch.zeros(4) for _ in range(2)]
    scales = [torch.ones(()) for _ in range(2)]
    update = DelayedUpdate(hist, scales, 4, torch.device("cuda"))  # (host tensors: only the pointers are read)
    watch = _Watch(2, mapped)
    return [(update, (448.0, 1, "max"), watch, ["q0", "q1"])], scales, update, watch


def _fast_update(monkeypatch, fast, mapped=(4096, 8192, bytes(2))):
    steps, scales, update, watch = _steps(mapped)
    monkeypatch.setattr(_extension, "fast_ops", lambda: fast)
    fu = object.__new__(amax_reduction._FastUpdate)  # (its quantizer checks are not under test here)
    fu.checks, fu.steps, fu.scales = [], steps, scales
    fu.cpp = amax_reduction._cpp_updates(fu.steps, fu.scales)
    return fu, update, watch


def test_built_from_the_pointer_table_sizes_recipe_numbers_and_mapped_flags(monkeypatch):
    fast = _Fast(True)
    fu, update, watch = _fast_update(monkeypatch, fast)
    assert fu.cpp is not None and len(fast.built) == 1
    device, batches, scales = fast.built[0]
    assert device == -1  # an index-less device: the current one
    assert batches == [(update.table_ptr, 2, 4, 448.0, 1, True, 4096, 2)]
    assert scales is fu.scales
    # flags on the device (no mapped memory): host address 0, the C++ call says "report"
    fast2 = _Fast(False)
    _fast_update(monkeypatch, fast2, mapped=())
    assert fast2.built[0][1][0][6:] == (0, 0)


def test_reports_skipped_only_when_the_flags_were_read_clear(monkeypatch):
    fast = _Fast(True)
    fu, update, watch = _fast_update(monkeypatch, fast)
    fu.run()
    assert fast.runs == 1 and watch.reports == 0  # clear: nothing to report
    fast.result = False  # a flag set, flags on the device, or a capture
    fu.run()
    assert fast.runs == 2 and watch.reports == 1
    fast.result = True
    monkeypatch.setitem(nonfinite._DEFERRED, 12345, object())  # a capture is counting eager reports
    fu.run()
    assert fast.runs == 3 and watch.reports == 2


def test_another_device_or_no_host_path_runs_the_python_launches(monkeypatch):
    fast = _Fast(None)  # the C++ call declined (another device is current): nothing launched there
    fu, update, watch = _fast_update(monkeypatch, fast)
    calls = []
    fu.steps = [(lambda *a: calls.append(a), args, w, qs) for (_, args, w, qs) in fu.steps]
    fu.run()
    assert fast.runs == 1 and calls == [(448.0, 1, "max")] and watch.reports == 1
    monkeypatch.setattr(_extension, "fast_ops", lambda: None)  # FP_RECIPES_TORCH_OPS=off (or an A/B's toggle)
    fu.run()
    assert fast.runs == 1 and len(calls) == 2 and watch.reports == 2


def test_no_builder_without_the_class_or_across_devices(monkeypatch):
    monkeypatch.setattr(_extension, "fast_ops", lambda: object())  # an older module without DelayedUpdates
    steps, scales, update, watch = _steps()
    assert amax_reduction._cpp_updates([(update, (448.0, 0, "max"), watch, [])], scales) is None
    fast = _Fast(True)
    monkeypatch.setattr(_extension, "fast_ops", lambda: fast)
    other = DelayedUpdate([torch.zeros(4)], [torch.ones(())], 4, torch.device("cuda", 1))
    mixed = [(update, (448.0, 0, "max"), watch, []), (other, (448.0, 0, "max"), watch, [])]
    assert amax_reduction._cpp_updates(mixed, scales) is None and not fast.built
    on_cpu = DelayedUpdate([torch.zeros(4)], [torch.ones(())], 4, torch.device("cpu"))
    assert amax_reduction._cpp_updates([(on_cpu, (448.0, 0, "max"), watch, [])], scales) is None and not fast.built
