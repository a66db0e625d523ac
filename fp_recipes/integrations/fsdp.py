"""FSDP2 (``fully_shard``) with weights all-gathered already quantized.

Without this, FSDP2 all-gathers each weight in its parameter dtype (FP32 or BF16) and every rank then
quantizes the same full weight. :func:`enable_quantized_all_gather` makes each rank quantize only its
own shard *before* the all-gather, through FSDP2's extension points (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the sharded parameter's local tensor), so the collective moves FP8 bytes
(1 byte per element) or NVFP4 nibbles and E4M3 block scales (0.5625 bytes per element per copy)
instead of 2 or 4, and the GEMM consumes the gathered tensor without a second cast.

Exactness: a per-tensor scale must be the same on every rank, so the shard quantization uses the
*global* amax of the weight (one all-reduce of a scalar over the shard group for current scaling and
NVFP4, or one for all weights after each optimizer step with :func:`precompute_weight_amaxes`; delayed
scaling uses the module's scale, which is identical on every rank because its amaxes are MAX-reduced
over the world group). NVFP4 blocks (16 elements along K, 16 rows for the columnwise
copy and 2-D tiles) never straddle a shard when each rank holds a multiple of 16 rows. So the
gathered bytes equal those of quantizing the whole weight, and results equal the unsharded module's
bit for bit.

Usage (before ``fully_shard``)::

    enable_quantized_all_gather(model, recipe)      # recipe: the one the model trains under
    for block in model.layers: fully_shard(block)
    fully_shard(model)
    with fp_recipes.autocast(recipe=recipe): ...
    optimizer.step(); precompute_weight_amaxes(model)   # the next gathers' amaxes in one all-reduce

Scope: ``Linear`` and ``LayerNormLinear`` weights (``GroupedLinear`` experts keep the ordinary
all-gather); recipes DelayedScaling, Float8CurrentScaling and NVFP4BlockScaling. The recipe is fixed
at enable time (FSDP2 sizes its all-gather buffers once): running the module under a recipe whose
weight format differs is an error. Outside an enabled autocast the module sees the dequantized
gathered weight.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_map_only

from ..autocast import get_autocast_state

__all__ = ["QuantizedAllGatherWeight", "GatheredQuantizedWeight", "enable_quantized_all_gather",
           "all_gather_bytes", "precompute_weight_amaxes"]

_aten = torch.ops.aten

# Ops FSDP2 (and module.to / deepcopy) applies to the parameter that must keep it our subclass: the
# sharding splits, views and copies, and the allocations of same-kind buffers.
_KEEP_SUBCLASS = {
    _aten.detach.default, _aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default,
    _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default,
    _aten.narrow.default, _aten.clone.default, _aten.empty_like.default, _aten.zeros_like.default,
    _aten.new_zeros.default, _aten.new_empty.default, _aten._to_copy.default, _aten.copy_.default,
    _aten._pin_memory.default, _aten.alias.default,
}


# ----------------------------------------------------------------------------------------------
# the sharded parameter: a full-precision weight that knows how to be gathered quantized


class QuantizedAllGatherWeight(torch.Tensor):
    """The high-precision (master) weight of a module, as a tensor subclass whose FSDP2 all-gather
    sends the quantized shard. Every op other than FSDP2's own views/copies runs on the plain tensor
    (the optimizer updates it in place)."""

    _inner: torch.Tensor
    _owner: "_Owner"

    @staticmethod
    def __new__(cls, inner: torch.Tensor, owner: "_Owner") -> "QuantizedAllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=inner.device, layout=inner.layout, requires_grad=False)

    def __init__(self, inner: torch.Tensor, owner: "_Owner") -> None:
        self._inner = inner
        self._owner = owner

    def __repr__(self) -> str:
        return f"QuantizedAllGatherWeight({self._inner!r})"

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, distributed checkpoints) as the plain weight it wraps: checkpoints stay
        # loadable without fp_recipes and into models without the quantized all-gather.
        return self._inner.detach().__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_inner"], self._owner

    @staticmethod
    def __tensor_unflatten__(inner_tensors, owner, outer_size, outer_stride):
        return QuantizedAllGatherWeight(inner_tensors["_inner"], owner)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = None

        def unwrap(t: "QuantizedAllGatherWeight") -> torch.Tensor:
            nonlocal owner
            owner = t._owner
            return t._inner

        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
        if func in _KEEP_SUBCLASS:
            return tree_map_only(torch.Tensor, lambda t: cls(t, owner), out)
        if func._schema.is_mutable and args and isinstance(args[0], cls):
            return args[0]  # an in-place op (optimizer step) returns its own (subclass) argument
        return out

    # ---- FSDP2 extension points --------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self._owner.pre_all_gather(self._inner, mesh, torch.Size(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return self._owner.post_all_gather(all_gather_outputs, metadata, param_dtype, out)


# ----------------------------------------------------------------------------------------------
# the unsharded parameter: the gathered quantized weight


class _Holder:
    """The gathered quantized tensor, shared by every alias FSDP2 makes of the unsharded parameter
    (``as_strided``, ``detach`` into an ``nn.Parameter``), so a later all-gather updates them all."""

    __slots__ = ("quantized", "spec")

    def __init__(self, quantized: Any, spec: Any) -> None:
        self.quantized = quantized
        self.spec = spec


class GatheredQuantizedWeight(torch.Tensor):
    """The unsharded weight after a quantized all-gather: carries the quantized tensor, which the
    module's GEMM uses as its weight operand. Any other op sees the dequantized weight."""

    _holder: _Holder

    @staticmethod
    def __new__(cls, holder: _Holder, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                requires_grad: bool = False) -> "GatheredQuantizedWeight":
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, holder: _Holder, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 requires_grad: bool = False) -> None:
        self._holder = holder

    def __repr__(self) -> str:
        return f"GatheredQuantizedWeight({self._holder.quantized!r})"

    def fp_recipes_prequantized(self, quantizer: Any) -> Any:
        """The gathered tensor for the module's weight quantizer; an error if it was gathered for a
        different format (the recipe was fixed by :func:`enable_quantized_all_gather`)."""
        spec = self._holder.spec
        if quantizer.spec.scaling is not spec.scaling or quantizer.spec.fmt is not spec.fmt \
                or quantizer.spec.block_2d != spec.block_2d or quantizer.spec.four_over_six != spec.four_over_six:
            raise RuntimeError(
                f"quantized all-gather: this weight was gathered as {spec.scaling.value}/{spec.fmt.value} "
                f"(the recipe given to enable_quantized_all_gather) but the module now runs "
                f"{quantizer.spec.scaling.value}/{quantizer.spec.fmt.value}. Use the same recipe, or "
                "enable the quantized all-gather with the recipe you train under")
        return self._holder.quantized

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default, _aten.as_strided.default,
                    _aten.view.default, _aten._unsafe_view.default):
            src = args[0]
            shape = torch.Size(args[1]) if func in (_aten.as_strided.default, _aten.view.default,
                                                   _aten._unsafe_view.default) else src.shape
            if shape.numel() == src.shape.numel() and tuple(shape) == tuple(src._holder.quantized.shape):
                return cls(src._holder, shape, src.dtype, src.device)

        def plain(t: "GatheredQuantizedWeight") -> torch.Tensor:
            return t._holder.quantized.dequantize(t.dtype).reshape(t.shape)

        return func(*tree_map_only(cls, plain, args), **tree_map_only(cls, plain, kwargs))


# ----------------------------------------------------------------------------------------------
# per-parameter logic: which quantizer, what to gather, how to rebuild


@dataclass
class _GatherStats:
    calls: int = 0
    bytes_sent: int = 0           # bytes this rank contributed to all-gathers of this weight
    high_precision_bytes: int = 0  # what the ordinary all-gather would have sent
    amax_reduces: int = 0         # quantized gathers that all-reduced this weight's amax themselves
    amax_precomputed: int = 0     # quantized gathers that took it from precompute_weight_amaxes


class _Owner:
    """Binds one weight to its module and recipe: picks the quantizer, quantizes the shard with the
    global scale, and rebuilds the quantized tensor from the gathered pieces."""

    def __init__(self, module: torch.nn.Module, recipe: Any, gemm_index: int) -> None:
        self._module = weakref.ref(module)
        self.recipe = recipe
        self.gemm_index = gemm_index
        self.stats = _GatherStats()
        self._cache: Optional[Tuple[int, Any, Any]] = None  # (version, inputs, metadata)
        # from precompute_weight_amaxes: (the sharded parameter, its version, the shard group, the global amax)
        self._precomputed: Optional[Tuple[Any, int, Any, torch.Tensor]] = None
        self._columnwise_bufs: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    # -- the quantizer ----------------------------------------------------------------------------
    def quantizer(self) -> Any:
        """The module's weight quantizer for this gather: the recipe the module runs under now (the
        innermost enabled autocast, else the module's own recipe), else the recipe fixed at enable
        time (in the backward, which runs outside the autocast). Built without a forward's side
        effects: no checkpoint record is pushed and no autocast is entered (its exit would flush the
        pending amaxes of other modules in the middle of a forward)."""
        module = self._module()
        if module is None:
            raise RuntimeError("quantized all-gather: the module owning this weight is gone")
        state = get_autocast_state()
        recipe = (state.recipe if state.enabled else None) if state.depth else module.recipe
        if recipe is not None:
            sets = module._sets_for(recipe, False)
        else:
            sets = module.quantizer_sets
            if sets is None or not _same_weight_format(sets[self.gemm_index].weight, self.recipe, module):
                sets = module._sets_for(self.recipe, False)
        q = sets[self.gemm_index].weight
        if q is None:
            raise RuntimeError(f"quantized all-gather: {type(recipe or self.recipe).__name__} keeps the "
                               "weight in high precision; there is nothing to gather quantized")
        if not _same_weight_format(q, self.recipe, module):
            want = self.recipe.plan(q.spec.role)
            raise RuntimeError(
                f"quantized all-gather: this weight is gathered as {want.scaling.value}/{want.fmt.value} "
                f"(the recipe given to enable_quantized_all_gather, which sized FSDP2's buffers) but the "
                f"module now runs {q.spec.scaling.value}/{q.spec.fmt.value}. Use the same recipe, or "
                "enable the quantized all-gather with the recipe you train under")
        return q

    # -- FSDP2 hooks ------------------------------------------------------------------------------
    def pre_all_gather(self, shard: torch.Tensor, mesh: Any, outer_size: torch.Size):
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and self._cache is not None and self._cache[0] == shard._version:
            # the forward's quantized shard, as the unsharded module's backward uses the weight its forward saved
            # (the local tensor's version never moves: the optimizer's update reaches it below autograd)
            inputs, meta = self._cache[1], self._cache[2]
        else:
            with torch.no_grad():
                inputs, meta = self._quantize_shard(shard, mesh, outer_size)
            self._cache = (shard._version, inputs, meta)
        self.stats.calls += 1
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t in inputs)
        self.stats.high_precision_bytes += shard.numel() * shard.element_size()
        return tuple(inputs), meta

    def _quantize_shard(self, shard: torch.Tensor, mesh: Any, outer_size: torch.Size):
        from ..quantizers.roles import ScalingKind

        q = self.quantizer()
        spec = q.spec
        group = mesh.get_group() if mesh is not None else None
        world = torch.distributed.get_world_size(group) if group is not None else 1
        rows, cols = int(outer_size[0]), int(outer_size[-1]) if len(outer_size) > 1 else 1
        local = shard.reshape(-1, cols) if shard.dim() != 2 else shard
        pad_rows = -(-rows // world)  # FSDP2's padded shard: ceil(rows / world)
        if spec.scaling is ScalingKind.NVFP4:
            if rows % (16 * world):
                raise ValueError(
                    f"quantized all-gather of an NVFP4 weight with {rows} rows over {world} ranks: each "
                    f"rank must hold a multiple of 16 rows (rows divisible by {16 * world}) so no 16-row "
                    "block straddles two shards. Use a different shard count or the ordinary all-gather")
            amax = self._global_amax(shard, local, group)
            qt = q.quantize(local, amax=amax)
            inputs = [qt.data, qt.scale.view(torch.uint8)]
            if qt.data_t is not None:
                inputs += [qt.data_t.t().contiguous(), qt.scale_t.view(torch.uint8).t().contiguous()]
            meta = ("nvfp4", spec, qt.amax, qt.amax_t, qt.orig_dtype, (rows, cols), world)
            return inputs, meta
        if spec.scaling is ScalingKind.CURRENT:
            qt = q.quantize(local, amax=self._global_amax(shard, local, group))
        elif spec.scaling is ScalingKind.DELAYED:
            # The module's scale (equal on all ranks). The history gets the *whole* weight's amax, as
            # the unsharded module's would: the shard amax the quantizer records is only reduced over
            # the amax reduction group, which need not be the shard group (reduce_amax=False, or an
            # explicit group), and a rank whose scale drifted would decode the others' bytes wrongly.
            amax = self._global_amax(shard, local, group)
            qt = q.quantize(local)
            q.record_amax(amax)
            qt.amax = amax
        else:
            raise NotImplementedError(
                f"quantized all-gather supports delayed, current and NVFP4 scaling, not {spec.scaling.value}")
        data = qt.rowwise_data().view(torch.uint8)
        if data.shape[0] != pad_rows:  # an uneven last shard: FSDP2 wants the padded shard size
            data = torch.nn.functional.pad(data, (0, 0, 0, pad_rows - data.shape[0]))
        meta = ("float8", spec, qt.scale_inv, qt.amax, qt.fmt, qt.orig_dtype, (rows, cols), world)
        return [data], meta

    def _sharded_param(self, shard: torch.Tensor) -> Optional[torch.Tensor]:
        """The module's sharded parameter (FSDP2's DTensor) whose local tensor wraps ``shard``, or None."""
        module = self._module()
        param = getattr(module, "weight", None) if module is not None else None
        return param if _local_shard(param) is shard else None

    def _global_amax(self, shard: torch.Tensor, local: torch.Tensor, group: Any) -> torch.Tensor:
        """The whole weight's amax: precompute_weight_amaxes' value while the sharded parameter is unchanged since
        (its version counter: the optimizer's in-place update bumps the DTensor's; the local tensor's does not move,
        the update reaching it below autograd), else one all-reduce of its own. Every rank decides alike: the
        optimizer steps every rank's shard."""
        pre = self._precomputed
        param = self._sharded_param(shard)
        if pre is not None and param is not None and pre[0]() is param and pre[1] == param._version and pre[2] is group:
            self.stats.amax_precomputed += 1
            return pre[3]
        self.stats.amax_reduces += 1
        return _global_amax(local, group)

    def post_all_gather(self, outputs, meta, param_dtype, out):
        from ..quantizers.float8 import Float8Tensor
        from ..quantizers.nvfp4 import NVFP4Tensor
        from .. import formats

        kind, spec = meta[0], meta[1]
        if kind == "float8":
            _, _, scale_inv, amax, fmt, orig_dtype, (rows, cols), world = meta
            data = outputs[0][:rows].view(formats.FP8_DTYPE[fmt])
            quantized = Float8Tensor(data, scale_inv, amax, fmt, param_dtype, (rows, cols))
            inner: List[torch.Tensor] = []
        else:
            _, _, amax, amax_t, orig_dtype, (rows, cols), world = meta
            data, scale = outputs[0], outputs[1].view(torch.float8_e4m3fn)
            data_t = scale_t = None
            inner = []
            if len(outputs) > 2:
                # Each rank sent its columnwise copy transposed (its rows first): undo the transpose.
                # FSDP2 frees these buffers after the forward and re-allocates them before the
                # backward's all-gather; a backward GEMM may hold the forward's tensor, so the same
                # buffers are refilled in place rather than replaced.
                if out is not None and self._columnwise_bufs is not None:
                    data_t, scale_t = self._columnwise_bufs
                    # the same values the forward saw (the weights did not change in between), so
                    # autograd's saved-tensor version check has nothing to catch: keep the version
                    with torch.autograd._unsafe_preserve_version_counter(data_t), \
                            torch.autograd._unsafe_preserve_version_counter(scale_t):
                        data_t.copy_(outputs[2].t())
                        scale_t.view(torch.uint8).copy_(outputs[3].t())
                else:
                    data_t = outputs[2].t().contiguous()
                    scale_t = outputs[3].t().contiguous().view(torch.float8_e4m3fn)
                    self._columnwise_bufs = (data_t, scale_t)
                inner = [data_t, scale_t]
            quantized = NVFP4Tensor(data, scale, amax, data_t, scale_t, amax_t if data_t is not None else None,
                                    row_scaled=spec.row_scaled, e4m3_max=spec.e4m3_max,
                                    four_over_six=spec.four_over_six, rht_columnwise=False,
                                    orig_dtype=param_dtype, shape=(rows, cols))
        if out is not None:
            out._holder.quantized = quantized
            out._holder.spec = spec
            return None
        holder = _Holder(quantized, spec)
        return GatheredQuantizedWeight(holder, torch.Size((rows, cols)), param_dtype,
                                       outputs[0].device), tuple(inner)


def _local_shard(param: Any) -> Optional[torch.Tensor]:
    """The plain shard inside a sharded parameter's local tensor: what FSDP2 hands fsdp_pre_all_gather (through the
    DTensor's ``_local_tensor``; ``to_local()`` would return an alias of it), or None."""
    return getattr(getattr(param, "_local_tensor", None), "_inner", None)


def _global_amax(local: torch.Tensor, group: Any) -> torch.Tensor:
    """max|w| over the whole weight: the local FP32 amax, MAX-reduced over the shard group."""
    amax = local.detach().abs().amax().float() if local.numel() else \
        torch.zeros((), dtype=torch.float32, device=local.device)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def _same_weight_format(q: Any, recipe: Any, module: torch.nn.Module) -> bool:
    if q is None:
        return False
    want = recipe.plan(q.spec.role)
    return want.scaling is q.spec.scaling and want.fmt is q.spec.fmt


# ----------------------------------------------------------------------------------------------
# public entry points


def enable_quantized_all_gather(model: torch.nn.Module, recipe: Any = None,
                                module_filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = None
                                ) -> List[str]:
    """Make the FSDP2 all-gather of every ``Linear``/``LayerNormLinear`` weight in ``model`` send the
    weight already quantized by ``recipe`` (None: ``recipe_from_env()``). Call it before
    ``fully_shard``. ``module_filter_fn(module, fqn) -> bool`` (torchao's convention) keeps a module
    on the ordinary all-gather when it returns False. Returns the names of the converted weights.
    """
    from ..modules.layernorm_linear import LayerNormLinear
    from ..modules.linear import Linear
    from ..recipes import Recipe, recipe_from_env
    from ..quantizers.roles import ScalingKind

    if recipe is None:
        recipe = recipe_from_env(default="delayed")
        if recipe is None:
            raise ValueError("enable_quantized_all_gather: FP_RECIPES_RECIPE=none turns quantization off; "
                             "pass a recipe or leave the all-gather in high precision")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"enable_quantized_all_gather: recipe must be an fp_recipes recipe, got "
                        f"{type(recipe).__name__}")
    converted: List[str] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, (Linear, LayerNormLinear)):
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        if _is_sharded(module.weight):
            raise RuntimeError(f"enable_quantized_all_gather: {fqn or 'the model'} is already sharded; call "
                               "it before fully_shard")
        spec = recipe.plan(_weight_role(module))
        if spec.scaling not in (ScalingKind.DELAYED, ScalingKind.CURRENT, ScalingKind.NVFP4):
            raise ValueError(f"enable_quantized_all_gather: {type(recipe).__name__} quantizes weights as "
                             f"{spec.scaling.value}; supported: DelayedScaling, Float8CurrentScaling, "
                             "NVFP4BlockScaling")
        if spec.backward_override is not None and spec.backward_override.value == "high_precision":
            raise ValueError("enable_quantized_all_gather: backward_override='high_precision' needs the "
                             "high-precision weight in the backward, which a quantized all-gather does "
                             "not gather; use 'dequantized' or no override")
        weight = module.weight
        if isinstance(weight, QuantizedAllGatherWeight) or isinstance(getattr(weight, "data", None),
                                                                     QuantizedAllGatherWeight):
            continue
        owner = _Owner(module, recipe, 0)
        module.weight = torch.nn.Parameter(QuantizedAllGatherWeight(weight.detach(), owner),
                                           requires_grad=weight.requires_grad)
        module._fp_recipes_all_gather_owner = owner
        converted.append(f"{fqn}.weight" if fqn else "weight")
    return converted


def precompute_weight_amaxes(model: torch.nn.Module) -> int:
    """The global amaxes of all of ``model``'s quantized-all-gather weights in one all-reduce per shard group,
    as torchao's ``precompute_float8_dynamic_scale_for_fsdp``: call it after ``optimizer.step()`` (and once before
    the first step), on every rank. Without it each weight's all-gather first all-reduces that weight's amax: one
    scalar collective per weight and gather, which on small weights costs more than the bytes the quantized
    all-gather saves (benchmarks/RESULTS.md, session 33). A weight's next gathers use the value while its shard
    is unchanged (its version counter); a weight changed since reduces its own amax again, so a stale value is
    never used. Values and results are bit-identical either way. Returns the number of weights precomputed
    (weights on a 2-D (HSDP) mesh keep their own reduction)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return 0
    by_group: Dict[Any, List[Tuple["_Owner", torch.Tensor, torch.Tensor]]] = {}
    for module in model.modules():
        owner = getattr(module, "_fp_recipes_all_gather_owner", None)
        weight = getattr(module, "weight", None)
        if owner is None or not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1:
            continue
        shard = _local_shard(weight)
        if shard is not None:
            by_group.setdefault(weight.device_mesh.get_group(), []).append((owner, weight, shard))
    count = 0
    for group, members in by_group.items():
        with torch.no_grad():
            local = [_global_amax(shard.reshape(-1), None) for _, _, shard in members]  # the per-gather form
            amaxes = torch.stack(local)
            if torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
        # (views of the reduced vector, which nothing writes again: no copy launch per weight)
        for (owner, weight, _), amax in zip(members, amaxes.unbind(0)):
            owner._precomputed = (weakref.ref(weight), weight._version, group, amax)
        count += len(members)
    return count


def all_gather_bytes(model: torch.nn.Module) -> Dict[str, Tuple[int, int]]:
    """Per converted module: (bytes this rank sent in its all-gathers, bytes the ordinary
    high-precision all-gather would have sent), summed over all all-gathers so far."""
    out: Dict[str, Tuple[int, int]] = {}
    for fqn, module in model.named_modules():
        owner = getattr(module, "_fp_recipes_all_gather_owner", None)
        if owner is not None:
            out[fqn] = (owner.stats.bytes_sent, owner.stats.high_precision_bytes)
    return out


def _weight_role(module: torch.nn.Module):
    from ..quantizers.roles import QuantizerRole, TensorKind

    return QuantizerRole(module.module_kind, TensorKind.WEIGHT, 0)


def _is_sharded(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)
