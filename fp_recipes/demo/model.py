"""The demo's language model: a small GPT built from fp_recipes modules.

Each block: ``LayerNormLinear`` for QKV, causal attention (torch's SDPA, high precision), ``Linear``
for the projection; then a feed-forward that is either dense (``LayerNormLinear`` FC1, GELU,
``Linear`` FC2) or a mixture of experts (a learned top-k router, tokens permuted so each expert's
rows are contiguous, ``GroupedLinear`` FC1 and FC2, outputs un-permuted and weighted by the router).
Dense and MoE blocks alternate. The embedding, the router and the LM head stay in high precision,
as in TransformerEngine/Megatron FP8 training.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from ..autocast import get_autocast_state
from ..modules import GroupedLinear, LayerNormLinear, Linear

__all__ = ["ModelConfig", "SIZES", "GPT"]


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    d_ffn: int
    experts: int
    top_k: int
    seq_len: int
    batch: int  # sequences per step
    lr: float

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


# tiny: CPU CI and --quick; small: a laptop-sized run; medium: a quick GPU run; large: the GPU default,
# GEMMs large enough for FP8 to pay (on an H100 the smaller sizes are host-bound: BF16 wins there)
SIZES: Dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ffn=128, experts=4, top_k=2,
                        seq_len=64, batch=16, lr=5e-3),
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=4, d_ffn=768, experts=4, top_k=2,
                         seq_len=128, batch=16, lr=2e-3),
    "medium": ModelConfig(d_model=1024, n_layers=6, n_heads=16, d_ffn=4096, experts=8, top_k=2,
                          seq_len=512, batch=16, lr=6e-4),
    "large": ModelConfig(d_model=2048, n_layers=6, n_heads=16, d_ffn=5632, experts=8, top_k=2,
                         seq_len=1024, batch=32, lr=3e-4),
}


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = LayerNormLinear(cfg.d_model, 3 * cfg.d_model, **kw)
        self.proj = Linear(cfg.d_model, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class DenseFFN(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.fc1 = LayerNormLinear(cfg.d_model, cfg.d_ffn, **kw)
        self.fc2 = Linear(cfg.d_ffn, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.fc2(F.gelu(self.fc1(x))), x.new_zeros((), dtype=torch.float32)


EXPERT_ROW_MULTIPLE = 16  # rows per expert are padded to this (see MoEFFN.forward)


class MoEFFN(torch.nn.Module):
    """Top-k routed experts. The load-balancing loss (Switch Transformer's) keeps every expert fed."""

    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.experts, self.top_k = cfg.experts, cfg.top_k
        self.norm = torch.nn.LayerNorm(cfg.d_model, device=kw.get("device"), dtype=kw.get("params_dtype"))
        self.router = torch.nn.Linear(cfg.d_model, cfg.experts, bias=False, device=kw.get("device"))
        self.fc1 = GroupedLinear(cfg.experts, cfg.d_model, cfg.d_ffn, **kw)
        self.fc2 = GroupedLinear(cfg.experts, cfg.d_ffn, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        h = self.norm(x).reshape(-1, shape[-1])
        probs = self.router(h.float()).softmax(-1)  # the router runs in FP32
        gate, expert = probs.topk(self.top_k, dim=-1)
        gate = gate / gate.sum(-1, keepdim=True)
        flat_expert = expert.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # permutation: each expert's rows contiguous
        token = order // self.top_k
        counts = torch.bincount(flat_expert, minlength=self.experts)
        # Under a quantization recipe each expert's rows are padded to a multiple of 16 with zero rows (as
        # Megatron's moe_router_padding_for_fp8 does): FP8 GEMMs contract over tokens in the weight gradient and
        # need multiples of 16 there, and the casts' transposed copies are vectorised only then. A zero
        # row changes no other row's output and adds nothing to a gradient (its output is dropped).
        if get_autocast_state().enabled:
            m = EXPERT_ROW_MULTIPLE
            padded = (counts + (m - 1)) // m * m
            splits = padded.tolist()
            starts = torch.cumsum(counts, 0) - counts
            padded_starts = torch.cumsum(padded, 0) - padded
            sorted_expert = flat_expert[order]
            slot = padded_starts[sorted_expert] + torch.arange(order.numel(), device=order.device) \
                - starts[sorted_expert]
            rows = torch.full((sum(splits),), h.shape[0], dtype=torch.long, device=h.device)  # the zero row
            rows[slot] = token
            h_zero = torch.cat([h, h.new_zeros(1, h.shape[1])])
            y = self.fc2(F.gelu(self.fc1(h_zero[rows], splits)), splits)[slot]
        else:  # BF16 / FP32: no padding
            splits = counts.tolist()
            y = self.fc2(F.gelu(self.fc1(h[token], splits)), splits)
        y = y * gate.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(h).index_add_(0, token, y)  # un-permute and sum the k experts
        frac = counts.float() / flat_expert.numel()
        aux = self.experts * (frac * probs.mean(0)).sum()
        return out.reshape(shape), aux


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool, **kw) -> None:
        super().__init__()
        self.attn = Attention(cfg, **kw)
        self.ffn = MoEFFN(cfg, **kw) if moe else DenseFFN(cfg, **kw)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(x)
        y, aux = self.ffn(x)
        return x + y, aux


class GPT(torch.nn.Module):
    """Byte-level causal LM; ``forward(tokens)`` returns (logits, load-balancing loss)."""

    def __init__(self, cfg: ModelConfig, vocab: int = 256, device=None, dtype=torch.float32) -> None:
        super().__init__()
        kw = {"device": device, "params_dtype": dtype}
        self.cfg = cfg
        self.embed = torch.nn.Embedding(vocab, cfg.d_model, device=device, dtype=dtype)
        self.pos = torch.nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model, device=device, dtype=dtype))
        self.blocks = torch.nn.ModuleList(Block(cfg, moe=i % 2 == 1, **kw) for i in range(cfg.n_layers))
        self.norm = torch.nn.LayerNorm(cfg.d_model, device=device, dtype=dtype)
        self.head = torch.nn.Linear(cfg.d_model, vocab, bias=False, device=device, dtype=dtype)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2 or name.split(".")[-1].startswith("weight") and p.dim() > 1:
                p.normal_(0.0, std)
            elif "bias" in name:
                p.zero_()
        for blk in self.blocks:  # GPT-2's scaled init of the residual projections
            outs = [blk.attn.proj.weight]
            outs += [blk.ffn.fc2.weight] if isinstance(blk.ffn, DenseFFN) else blk.ffn.fc2.weights()
            for w in outs:
                w.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        aux = x.new_zeros((), dtype=torch.float32)
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        return self.head(self.norm(x)), aux
