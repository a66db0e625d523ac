"""Test-side helpers for the Megatron backend on CPU (gloo): the CUDA-only spots of megatron-core
patched for CPU (never in the library), process-group set-up, a tiny GPT, a deterministic batch and
a short training loop. Shared by the in-process tests and the torchrun worker."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, List, Optional

import torch

# Where the torchrun workers put the model: "cpu" (gloo; CI) or "cuda" (NCCL, one GPU per rank: the
# two-GPU runs of scripts/gpu_two.sh). The in-process tests always use the CPU.
DEVICE = os.environ.get("FP_RECIPES_TEST_DEVICE", "cpu")


def cpu_patches() -> List[tuple]:
    """(object, attribute, replacement) for the CUDA-only spots megatron-core hits when the model
    lives on the CPU: core attention's global buffer (allocated on CUDA), the CUDA RNG tracker
    (fork/states) and the reentrant checkpoint's CUDA RNG state. The tests keep the model on the CPU
    on every machine (gloo, CI's contract), so these apply with or without CUDA; every replacement
    does on the CPU what the original does on the GPU."""
    from megatron.core import utils as mutils
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tuple(tensor_shape), dtype=dtype)

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    cpu_state = lambda *a, **k: torch.get_rng_state()  # noqa: E731
    return [
        (mutils.GlobalMemoryBuffer, "get_tensor", get_tensor),
        (mrandom.CudaRNGStatesTracker, "fork", fork),
        (mrandom.CudaRNGStatesTracker, "get_states", lambda self: {}),
        (mrandom.CudaRNGStatesTracker, "set_states", lambda self, states: None),
        (mrandom, "_get_cuda_rng_state", cpu_state),
        (mrandom, "_set_cuda_rng_state", lambda state, *a, **k: None),
        # the MoE router and the sequence-parallel gather buffers place tensors on the current
        # CUDA device; on CPU that device is the CPU
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *a, **k: None),  # dist-checkpoint save
        # megatron-core 0.16.1's MoE router tests a name bound only when TE imports (NameError)
        (moe_utils, "te_general_gemm", None),
    ] + psutil_stand_in(filesystem_async)


def psutil_stand_in(filesystem_async: Any) -> List[tuple]:
    """Without psutil, the torch_dist writer's worker raises in ``_process_memory`` (a debug-log
    figure) before it signals completion, and ``dist_checkpointing.save`` waits forever on its
    count queue (found with py-spy: the main process in ``JoinableQueue.join``, the forked writers
    dead with "psutil is not installed"). Report 0 bytes instead when psutil is absent."""
    if getattr(filesystem_async, "HAVE_PSUTIL", True):
        return []
    return [(filesystem_async, "_process_memory", lambda: 0)]


@contextlib.contextmanager
def megatron_on_cpu(tp: int = 1):
    """The patches (undone on exit) and Megatron's parallel state for in-process tests."""
    import pytest
    import torch.distributed as dist
    from megatron.core import parallel_state

    with pytest.MonkeyPatch.context() as mp:
        apply_cpu_patches(lambda obj, name, value: mp.setattr(obj, name, value, raising=False))
        owned = not dist.is_initialized()
        init_parallel(tp)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if owned:
                dist.destroy_process_group()


def apply_cpu_patches(setattr_fn: Callable[[Any, str, Any], None] = setattr) -> None:
    if DEVICE == "cuda":  # a worker on the GPUs needs none of them
        return
    for obj, name, value in cpu_patches():
        setattr_fn(obj, name, value)


def init_parallel(tp: int = 1, ep: int = 1) -> None:
    """gloo process group (world of one in-process unless torchrun set one up) + Megatron's groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        if DEVICE == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep)


def tiny_config(**overrides: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: Dict[str, Any] = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                              bias_dropout_fusion=False, masked_softmax_fusion=False,
                              bias_activation_fusion=False, apply_rope_fusion=False,
                              gradient_accumulation_fusion=False, params_dtype=torch.float32,
                              persist_layer_norm=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def moe_overrides(**kw: Any) -> Dict[str, Any]:
    out = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=True,
               moe_token_dispatcher_type="allgather", add_bias_linear=False, moe_aux_loss_coeff=0.0,
               )
    out.update(kw)
    return out


VOCAB, SEQ, BATCH = 128, 32, 2

NVFP4_ROW_4OVER6 = dict(row_scaled_activation=True, nvfp4_4over6="all", disable_rht=True,
                        disable_2d_quantization=True, disable_stochastic_rounding=True)


def quant_recipe_config(fc: Optional[Dict[str, Any]] = None):
    """Megatron ``quant_recipe`` matchers mixing recipes per module: layer 0's linear_proj BF16, the
    dense MLP's fc1/fc2 NVFP4 (``fc``: the payload, default row-scaled + 4over6), the rest delayed
    FP8 (history 4)."""
    from megatron.core.quantization.quant_config import RecipeConfig

    return RecipeConfig.from_config_dict({
        "configs": {"nv": fc or {"recipe": "nvfp4", **NVFP4_ROW_4OVER6},
                    "fp8": {"recipe": "delayed", "amax_history_len": 4},
                    "off": {"recipe": "none"}},
        "matchers": {
            "proj0": {"type": "glob", "pattern": "*layers.0.self_attention.linear_proj", "config": "off",
                      "enabled": True},
            "fc": {"type": "glob", "pattern": "*mlp.linear_fc*", "config": "nv", "enabled": True},
            "rest": {"type": "glob", "pattern": "*", "config": "fp8", "enabled": True},
        }})


def build_gpt(config, spec, seed: int = 1234):
    """A GPTModel built after the same seeding, so equal specs give equal weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if DEVICE == "cuda":
        model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    return model.to(DEVICE)  # built on the CPU (use_cpu_initialization), then moved


def local_spec(config):
    """Megatron's own local spec (the reference backend)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                    moe_grouped_gemm=False, normalization=config.normalization)


def make_batch(step: int = 0, batch: int = BATCH, seq: int = SEQ):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    mask = torch.ones(batch, 1, seq, seq, dtype=torch.bool).tril().logical_not()
    return tuple(t.to(DEVICE) for t in (tokens[:, :-1].contiguous(), position_ids, mask,
                                        tokens[:, 1:].contiguous()))


def loss_of(model, step: int = 0) -> torch.Tensor:
    tokens, pos, mask, labels = make_batch(step)
    return model(tokens, pos, mask, labels=labels).float().mean()


def allreduce_grads(model) -> None:
    """What Megatron's finalize_model_grads does for sequence-parallel norm/bias grads at TP>1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    for p in model.parameters():
        if p.grad is not None and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())


def train(model, steps: int, lr: float = 1e-2, start: int = 0, opt: Optional[torch.optim.Optimizer] = None,
          step_fn: Optional[Callable] = None) -> List[float]:
    opt = opt or torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for s in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, s)
        loss.backward()
        allreduce_grads(model)
        opt.step()
        losses.append(loss.item())
        if step_fn is not None:
            step_fn(s)
    return losses


def save_checkpoint(model, directory: str) -> None:
    """Megatron's distributed checkpoint of ``model`` (default torch_dist strategy, synchronous)."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def load_checkpoint(model, directory: str) -> None:
    """Load a distributed checkpoint into ``model`` as Megatron's training loop does (strict)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result


def quantizer_state(model) -> Dict[str, torch.Tensor]:
    """Every delayed-scaling tensor (scales, amax histories) by name, cloned."""
    return {k: b.detach().clone() for k, b in model.named_buffers() if ".qstate_" in k}
