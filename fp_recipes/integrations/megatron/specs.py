"""GPT layer / decoder-block specs on this backend: the one line a Megatron script changes."""

from __future__ import annotations

import inspect
from typing import Any, List, Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import gpt_layer_specs as _gpt_specs
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules, get_transformer_layer_offset

from .layer import FpRecipesTransformerLayer
from .norm import FpNorm
from .provider import FpRecipesSpecProvider

__all__ = ["get_gpt_layer_spec", "get_gpt_decoder_block_spec"]


def _mlp_spec(backend: FpRecipesSpecProvider, num_experts: Optional[int], moe_grouped_gemm: bool) -> Any:
    fn = _gpt_specs.get_mlp_module_spec_for_backend
    kwargs = {"backend": backend, "num_experts": num_experts, "moe_grouped_gemm": moe_grouped_gemm}
    if "moe_use_legacy_grouped_gemm" in inspect.signature(fn).parameters:
        kwargs["moe_use_legacy_grouped_gemm"] = False
    return fn(**kwargs)


def get_gpt_layer_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = True,
                       qk_layernorm: bool = False, recipe: Any = None,
                       backend: Optional[FpRecipesSpecProvider] = None) -> ModuleSpec:
    """A GPT ``TransformerLayer`` spec on fp_recipes modules (dense when ``num_experts`` is None).

    ``recipe``: an fp_recipes recipe all quantized modules use by default (else config.fp8/fp4)."""
    if backend is None:
        backend = FpRecipesSpecProvider(recipe=recipe)
    elif recipe is not None:
        raise ValueError("get_gpt_layer_spec: give recipe= or backend=, not both")
    qk_norm = backend.layer_norm(for_qk=True) if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=FpRecipesTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_layer_norm_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp,
            mlp=_mlp_spec(backend, num_experts, moe_grouped_gemm),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_gpt_decoder_block_spec(config: Any, recipe: Any = None, vp_stage: Optional[int] = None,
                               pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """The decoder block for ``config`` (dense, MoE, or mixed by ``config.moe_layer_freq``) on this
    backend, sliced to this pipeline stage; its final norm is :class:`FpNorm`."""
    backend = FpRecipesSpecProvider(recipe=recipe)
    dense = get_gpt_layer_spec(None, qk_layernorm=config.qk_layernorm, backend=backend)
    specs: List[ModuleSpec]
    if config.num_moe_experts:
        moe = get_gpt_layer_spec(config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                 qk_layernorm=config.qk_layernorm, backend=backend)
        freq = config.moe_layer_freq
        pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)] \
            if isinstance(freq, int) else list(freq)
        if len(pattern) != config.num_layers:
            raise ValueError(f"get_gpt_decoder_block_spec: config.moe_layer_freq has {len(pattern)} "
                             f"entries for {config.num_layers} layers")
        specs = [moe if p else dense for p in pattern]
    else:
        specs = [dense] * config.num_layers
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise ValueError("get_gpt_decoder_block_spec: config.pipeline_model_parallel_layout is not "
                         "supported by the fp_recipes backend helper; build the layer list yourself "
                         "from get_gpt_layer_spec")
    kw = {"vp_stage": vp_stage}
    if "pp_rank" in inspect.signature(get_num_layers_to_build).parameters:
        kw["pp_rank"] = pp_rank
    count = get_num_layers_to_build(config, **kw)
    offset = get_transformer_layer_offset(config, **kw)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count], layer_norm=FpNorm)
