"""Column/row-parallel grouped linears for Megatron's ``TEGroupedMLP`` (MoE experts), built on
:class:`fp_recipes.GroupedLinear`: one GEMM per local expert over its rows of the permuted tokens.

As in TransformerEngine's wrappers, the expert layers communicate nothing themselves: with expert
tensor parallelism or expert parallelism Megatron's token dispatcher moves the tokens, and each
rank holds its shard (``output_size / tp`` for fc1, ``input_size / tp`` for fc2)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from megatron.core.tensor_parallel.layers import (_initialize_affine_weight_cpu,
                                                  _initialize_affine_weight_gpu)
from megatron.core.utils import divide

from ...modules.grouped_linear import GroupedLinear
from .quant import MegatronQuantized

__all__ = ["FpColumnParallelGroupedLinear", "FpRowParallelGroupedLinear"]


def _pg_collection(pg_collection: Any) -> Any:
    if pg_collection is not None:
        return pg_collection
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


class _FpGroupedLinear(MegatronQuantized, GroupedLinear):
    parallel_mode = "column"

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any,
                 init_method: Callable, bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str] = None, pg_collection: Any = None,
                 name: Optional[str] = None) -> None:
        owner = type(self).__name__
        if not is_expert:
            raise ValueError(f"{owner}: is_expert=False is not supported (grouped linears are MoE "
                             "expert layers)")
        if bias and skip_bias_add:
            raise ValueError(f"{owner}: bias with skip_bias_add=True is not supported; set "
                             "config.add_bias_linear=False for the experts")
        if getattr(config, "fp8", None) or getattr(config, "fp4", None):
            raise ValueError(
                f"{owner}: MoE experts with config.fp8/config.fp4 are not supported: Megatron's "
                "TEGroupedMLP then pads tokens with TransformerEngine (absent here). Give the recipe "
                "through quant_recipe (config.fp8/fp4 unset) or FpRecipesSpecProvider(recipe=...); "
                "fp_recipes pads the NVFP4 token blocks itself")
        pgs = _pg_collection(pg_collection)
        self._pg_collection = pgs
        self.tp_group = pgs.expt_tp
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        full_in, full_out = input_size, output_size
        if self.parallel_mode == "column":
            output_size = divide(output_size, tp_size)
        else:
            input_size = divide(input_size, tp_size)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        GroupedLinear.__init__(self, num_gemms, input_size, output_size, bias=bias,
                               params_dtype=config.params_dtype, device=device)
        self.input_size, self.output_size = full_in, full_out
        self.skip_bias_add = skip_bias_add
        self.module_name = name
        self.expert_parallel = config.expert_model_parallel_size > 1
        dim = 0 if self.parallel_mode == "column" else 1
        for g in range(num_gemms):
            w = getattr(self, f"weight{g}")
            if config.perform_initialization:
                if config.use_cpu_initialization:
                    _initialize_affine_weight_cpu(w, full_out, full_in, w.shape[dim], dim, init_method,
                                                  params_dtype=config.params_dtype, rank=tp_rank,
                                                  world_size=tp_size)
                else:
                    _initialize_affine_weight_gpu(w, init_method, partition_dim=dim, is_expert=True)
            setattr(w, "allreduce", not self.expert_parallel)
            b = getattr(self, f"bias{g}")
            if b is not None:
                with torch.no_grad():
                    b.zero_()
                setattr(b, "allreduce", not self.expert_parallel)
        self._setup_quant(config)

    def forward(self, x: torch.Tensor, m_splits: Any):
        if isinstance(m_splits, torch.Tensor):
            m_splits = m_splits.tolist()
        out = GroupedLinear.forward(self, x, list(m_splits))
        return out, None

    # ------------------------------------------------------------------ dist checkpoint
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Per expert, the keys SequentialMLP/TEGroupedMLP use (``weight{i}`` at the global expert
        index along an expert axis, TP axis 0 for fc1 and 1 for fc2); the quantizer state of the
        module as one shard along the expert-parallel axis."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        from megatron.core.utils import get_pg_rank, get_pg_size
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        metadata = metadata or {}
        dp_cp = metadata.get("dp_cp_group")
        ep = self._pg_collection.ep
        num_global = get_pg_size(ep) * self.num_gemms
        offset = get_pg_rank(ep) * self.num_gemms
        ep_axis = len(sharded_offsets)
        full = self.state_dict(prefix="", keep_vars=True)
        tp_axis = 0 if self.parallel_mode == "column" else 1
        out = {}
        for g in range(self.num_gemms):
            sd = {f"{g}.weight": full.pop(f"weight{g}")}
            axes = {f"{g}.weight": tp_axis}
            if f"bias{g}" in full:
                sd[f"{g}.bias"] = full.pop(f"bias{g}")
                if tp_axis == 0:
                    axes[f"{g}.bias"] = 0
            sub = make_sharded_tensors_for_checkpoint(
                sd, "", axes, (*sharded_offsets, (ep_axis, offset + g, num_global)),
                tp_group=self.tp_group, dp_cp_group=dp_cp)
            replace_prefix_for_sharding(sub, f"{g}.", prefix)
            out[f"{prefix}weight{g}"] = sub[f"{g}.weight"]
            if f"{g}.bias" in sub:
                out[f"{prefix}bias{g}"] = sub[f"{g}.bias"]
        rest = make_sharded_tensors_for_checkpoint(
            full, prefix, None, (*sharded_offsets, (ep_axis, get_pg_rank(ep), get_pg_size(ep))),
            tp_group=self.tp_group, dp_cp_group=dp_cp)
        out.update(rest)
        return self.own_qstate_keys(out, prefix, ((0, get_pg_rank(ep), get_pg_size(ep)),))


class FpColumnParallelGroupedLinear(_FpGroupedLinear):
    """fc1 of the experts: weight shard along the output dim."""

    parallel_mode = "column"


class FpRowParallelGroupedLinear(_FpGroupedLinear):
    """fc2 of the experts: weight shard along the input dim."""

    parallel_mode = "row"
