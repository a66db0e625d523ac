"""A plain PyTorch training loop with fp_recipes, configured only by environment variables.

The way an RL or pretraining launch script toggles recipes without code changes: the model code calls
``fp_recipes.autocast()`` with no recipe, so the recipe is whatever the environment says when the loop
starts (``FP_RECIPES_RECIPE=none|delayed|current|nvfp4|per_token`` plus every ``NVTE_*`` field variable,
see ``python -m fp_recipes env``). AdamW, gradient accumulation, and checkpoint save/resume (model,
including the delayed-scaling state, optimizer and step: a resumed run continues bit for bit).

    FP_RECIPES_RECIPE=nvfp4 NVTE_NVFP4_4OVER6=weights python examples/train_gpt.py
    TRAIN_STEPS=200 TRAIN_CKPT=ckpt.pt python examples/train_gpt.py      # saves every TRAIN_SAVE_EVERY
    TRAIN_STEPS=400 TRAIN_CKPT=ckpt.pt python examples/train_gpt.py      # resumes from ckpt.pt

Knobs of this script (all optional): TRAIN_STEPS (100), TRAIN_GRAD_ACCUM (2), TRAIN_MICRO_BATCH (8),
TRAIN_SEQ_LEN (64), TRAIN_D_MODEL (128), TRAIN_LAYERS (2), TRAIN_LR (3e-3), TRAIN_SEED (0),
TRAIN_CKPT (a path: resume from it when it exists, save to it), TRAIN_SAVE_EVERY (50).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

import fp_recipes


def knob(name: str, default, cast=int):
    raw = os.environ.get(name, "").strip()
    try:
        return cast(raw) if raw else default
    except ValueError:
        raise SystemExit(f"train_gpt.py: {name}={raw!r} is not a valid {cast.__name__}") from None


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = fp_recipes.LayerNormLinear(d, 3 * d)
        self.proj = fp_recipes.Linear(d, d)
        self.fc1 = fp_recipes.LayerNormLinear(d, 4 * d)
        self.fc2 = fp_recipes.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(x)))


class GPT(torch.nn.Module):
    def __init__(self, d: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq_len, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads=4) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 256, bias=False)  # the LM head stays in high precision

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def text_bytes() -> torch.Tensor:
    """A few stdlib modules' source as bytes: real text, offline everywhere."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((root / name).read_bytes() for name in ("argparse.py", "os.py", "typing.py"))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main() -> None:
    steps, accum = knob("TRAIN_STEPS", 100), knob("TRAIN_GRAD_ACCUM", 2)
    micro, seq_len = knob("TRAIN_MICRO_BATCH", 8), knob("TRAIN_SEQ_LEN", 64)
    seed, save_every = knob("TRAIN_SEED", 0), knob("TRAIN_SAVE_EVERY", 50)
    ckpt = os.environ.get("TRAIN_CKPT") or None
    torch.manual_seed(seed)
    model = GPT(knob("TRAIN_D_MODEL", 128), knob("TRAIN_LAYERS", 2), seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=knob("TRAIN_LR", 3e-3, float), weight_decay=0.1)
    data = text_bytes()
    start = 0
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])  # includes each module's delayed-scaling state
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed from {ckpt} at step {start}")
    recipe = fp_recipes.recipe_from_env()  # what autocast() will use: say it in the log
    print("recipe:", "none (quantization off)" if recipe is None else recipe.describe().replace("\n", "; "))
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # batch of a step: same on resume
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accum):
            starts = torch.randint(0, data.numel() - seq_len - 1, (micro,), generator=gen)
            window = data[starts[:, None] + torch.arange(seq_len + 1)]
            with fp_recipes.autocast():  # the recipe comes from the environment
                logits = model(window[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten()) / accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        print(f"step {step + 1} loss {total!r}")
        if ckpt and ((step + 1) % save_every == 0 or step + 1 == steps):
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, ckpt)
            print(f"saved {ckpt} at step {step + 1}")


if __name__ == "__main__":
    main()
