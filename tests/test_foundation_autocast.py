"""autocast: state, nesting, restore on exceptions, recipe resolution, fp8_autocast, exit hooks."""

from __future__ import annotations

import gc
import importlib

import pytest

import fp_recipes
from fp_recipes import (
    DelayedScaling,
    Float8CurrentScaling,
    NVFP4BlockScaling,
    autocast,
    fp8_autocast,
    get_autocast_state,
)
from fp_recipes.autocast import register_outermost_exit_hook, unregister_outermost_exit_hook

autocast_module = importlib.import_module("fp_recipes.autocast")


@pytest.fixture(autouse=True)
def _no_leftover_state():
    assert get_autocast_state().depth == 0
    yield
    assert get_autocast_state().depth == 0


@pytest.fixture
def calls():
    seen = []
    handle = register_outermost_exit_hook(seen.append)
    yield seen
    handle.remove()


def test_outside_is_disabled():
    s = get_autocast_state()
    assert (s.enabled, s.recipe, s.amax_reduction_group, s.depth) == (False, None, None, 0)


def test_basic_state_and_default_recipe():
    group = object()
    with autocast(amax_reduction_group=group) as entered:
        s = get_autocast_state()
        assert s is entered
        assert s.enabled and s.depth == 1 and s.amax_reduction_group is group
        assert s.recipe == DelayedScaling()
    assert not get_autocast_state().enabled


def test_recipe_none_takes_fp_recipes_recipe(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_RECIPE", "nvfp4")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    with autocast():
        r = get_autocast_state().recipe
        assert isinstance(r, NVFP4BlockScaling) and r.disable_rht
    monkeypatch.setenv("FP_RECIPES_RECIPE", "none")
    with autocast():
        s = get_autocast_state()
        assert not s.enabled and s.recipe is None and s.depth == 1


def test_nesting_inner_wins_outer_restored():
    outer, inner = DelayedScaling(margin=1), Float8CurrentScaling()
    with autocast(recipe=outer):
        assert get_autocast_state().recipe is outer
        with autocast(recipe=inner):
            assert get_autocast_state().recipe is inner and get_autocast_state().depth == 2
            with autocast(enabled=False):
                s = get_autocast_state()
                assert not s.enabled and s.recipe is None and s.depth == 3
            assert get_autocast_state().recipe is inner
        assert get_autocast_state().recipe is outer and get_autocast_state().depth == 1
    assert get_autocast_state().depth == 0


def test_exception_restores_outer_state(calls):
    outer = DelayedScaling()
    with autocast(recipe=outer):
        with pytest.raises(RuntimeError, match="boom"):
            with autocast(recipe=NVFP4BlockScaling()):
                with autocast(enabled=False):
                    raise RuntimeError("boom")
        assert get_autocast_state().recipe is outer and get_autocast_state().depth == 1
    assert len(calls) == 1
    with pytest.raises(KeyError):
        with autocast():
            raise KeyError("x")
    assert get_autocast_state().depth == 0
    assert len(calls) == 1  # no hook on an exceptional exit


def test_hooks_fire_once_at_outermost_enabled_exit(calls):
    r = Float8CurrentScaling()
    with autocast(recipe=r):
        with autocast(recipe=DelayedScaling()):
            pass
        assert calls == []
        with autocast(enabled=False):
            pass
        assert calls == []
    assert len(calls) == 1
    state = calls[0]
    assert state.enabled and state.recipe is r and state.depth == 1
    # the outermost *enabled* context inside a disabled one
    with autocast(enabled=False):
        with autocast(recipe=r):
            pass
        assert len(calls) == 2 and calls[1].depth == 2
    with autocast(enabled=False):
        pass
    assert len(calls) == 2  # a disabled context never fires


def test_hook_sees_restored_state_and_order():
    order = []
    h1 = register_outermost_exit_hook(lambda s: order.append(("a", get_autocast_state().enabled)))
    h2 = register_outermost_exit_hook(lambda s: order.append(("b", s.enabled)))
    try:
        with autocast():
            pass
    finally:
        h1.remove()
        h2.remove()
    assert order == [("a", False), ("b", True)]


def test_unregister_by_handle_and_by_function():
    seen = []

    def hook(state):
        seen.append(state)

    handle = register_outermost_exit_hook(hook)
    with autocast():
        pass
    assert len(seen) == 1
    assert unregister_outermost_exit_hook(handle) is True
    assert unregister_outermost_exit_hook(handle) is False
    with autocast():
        pass
    assert len(seen) == 1
    register_outermost_exit_hook(hook)
    assert unregister_outermost_exit_hook(hook) is True
    with autocast():
        pass
    assert len(seen) == 1
    with register_outermost_exit_hook(hook):  # a handle is a context manager too
        with autocast():
            pass
    with autocast():
        pass
    assert len(seen) == 2


def test_weak_hook_goes_away_with_its_owner():
    seen = []

    class Owner:
        def on_exit(self, state):
            seen.append(state)

    owner = Owner()
    handle = register_outermost_exit_hook(owner.on_exit, weak=True)
    with autocast():
        pass
    assert len(seen) == 1
    del owner
    gc.collect()
    with autocast():
        pass
    assert len(seen) == 1 and handle.callback() is None


def test_hook_api_reachable_from_every_spelling():
    assert fp_recipes.autocast.register_outermost_exit_hook is register_outermost_exit_hook
    assert autocast_module.register_outermost_exit_hook is register_outermost_exit_hook
    assert autocast.unregister_outermost_exit_hook is unregister_outermost_exit_hook
    # the module object is callable too, so `fp_recipes.autocast(...)` works either way
    with autocast_module(recipe=DelayedScaling()) as s:
        assert s.enabled


def test_register_rejects_non_callables():
    with pytest.raises(TypeError):
        register_outermost_exit_hook(42)


def test_bad_arguments():
    with pytest.raises(TypeError, match="recipe"):
        with autocast(recipe="delayed"):
            pass
    with pytest.raises(TypeError, match="enabled"):
        autocast(enabled="yes")
    assert get_autocast_state().depth == 0


def test_fp8_autocast_alias(calls):
    r = DelayedScaling()
    g = object()
    with fp8_autocast(enabled=True, fp8_recipe=r, fp8_group=g):
        s = get_autocast_state()
        assert s.enabled and s.recipe is r and s.amax_reduction_group is g
    assert len(calls) == 1
    with fp8_autocast(False):
        assert not get_autocast_state().enabled
    with pytest.raises(ValueError, match="calibrating"):
        fp8_autocast(calibrating=True)


def test_decorator_and_reuse():
    ctx = autocast(recipe=Float8CurrentScaling())

    @ctx
    def depth_inside(n):
        return get_autocast_state().depth if n == 0 else depth_inside(n - 1)

    assert depth_inside(2) == 3  # re-entrant use of the same instance
    with ctx:
        with ctx:
            assert get_autocast_state().depth == 2


# ----------------------------------------------------------------------------------------------
# thread-local state (issue 11)


def _in_thread(fn):
    """Run fn() in a fresh thread; return its result (re-raise its exception)."""
    import threading

    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed back to the test thread)
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_another_thread_sees_the_default_state():
    with autocast(recipe=NVFP4BlockScaling()):
        other = _in_thread(get_autocast_state)
        assert get_autocast_state().enabled
    assert other == autocast_module.AutocastState() and not other.enabled and other.recipe is None


def test_nesting_is_per_thread_and_hooks_fire_per_thread(calls):
    import threading

    inner_entered, release = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with autocast(recipe=Float8CurrentScaling()):
            seen["depth_in_worker"] = get_autocast_state().depth
            inner_entered.set()
            release.wait(10)
        seen["worker_calls"] = len(calls)

    with autocast(recipe=DelayedScaling()):
        t = threading.Thread(target=worker)
        t.start()
        assert inner_entered.wait(10)
        # the worker's context is outermost in ITS thread even though this thread is inside one
        assert seen["depth_in_worker"] == 1 and get_autocast_state().depth == 1
        release.set()
        t.join()
        assert seen["worker_calls"] == 1 and isinstance(calls[0].recipe, Float8CurrentScaling)
    assert len(calls) == 2 and isinstance(calls[1].recipe, DelayedScaling)


def test_decorator_used_from_two_threads():
    r = DelayedScaling()

    @autocast(recipe=r)
    def depth():
        return get_autocast_state().depth

    with autocast(recipe=r):
        assert _in_thread(depth) == 1
        assert depth() == 2
