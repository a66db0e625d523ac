"""Text the demo trains on, as bytes: the running Python's standard-library source by default
(offline everywhere, a few MB of real code), or any file or folder given with ``--data``.

Byte-level tokens (vocabulary 256) need no download and no training of a tokenizer; every recipe
sees exactly the same batches because the batch positions come from one seeded generator.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

__all__ = ["DataError", "Corpus", "load_corpus", "stdlib_files"]

VOCAB = 256
_DEFAULT_BUDGET = 4 << 20  # bytes read from the stdlib: plenty for a short run, quick to load
_BLOCK = 16 << 10  # bytes per train/validation block


class DataError(ValueError):
    """The text to train on cannot be used (missing, empty, binary or too short)."""


def stdlib_files() -> List[Path]:
    """The ``*.py`` files of the running Python's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _is_text(head: bytes) -> bool:
    return b"\0" not in head


def _read_files(files: List[Path], budget: Optional[int]) -> bytes:
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data or not _is_text(data[:4096]):
            continue
        chunks.append(data)
        total += len(data)
        if budget is not None and total >= budget:
            break
    return b"\n".join(chunks)


@dataclass
class Corpus:
    """Train and validation bytes (every 10th block of the text is held out) and where they came from."""

    source: str
    train: torch.Tensor  # uint8
    val: torch.Tensor  # uint8

    @property
    def num_bytes(self) -> int:
        return self.train.numel() + self.val.numel()

    def unigram_loss(self) -> float:
        """Validation cross-entropy (nats/byte) of the train set's byte frequencies: what a model
        that learnt nothing about context would reach. The demo must end well below it."""
        counts = torch.bincount(self.train.long(), minlength=VOCAB).double() + 1.0  # add-one smoothing
        logp = (counts / counts.sum()).log()
        return float(-logp[self.val.long()].mean())

    def batch_starts(self, steps: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
        """(steps, batch) start positions in the train split, the same for every recipe."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.train.numel() - seq_len - 1, (steps, batch), generator=gen)

    def batch(self, starts: torch.Tensor, seq_len: int, split: str = "train"):
        data = self.train if split == "train" else self.val
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]

    def val_starts(self, num: int, seq_len: int) -> torch.Tensor:
        """Evenly spaced, non-random validation windows (a fixed held-out set)."""
        last = self.val.numel() - seq_len - 1
        return torch.linspace(0, last, num).long()


def load_corpus(path: Optional[str], seq_len: int, budget: Optional[int] = _DEFAULT_BUDGET) -> Corpus:
    """Read the text; :class:`DataError` with what was wrong when it cannot be used."""
    if path is None:
        files = stdlib_files()
        if not files:
            raise DataError(f"no *.py files under this Python's standard library "
                            f"({sysconfig.get_paths()['stdlib']}); pass --data PATH (a text file or folder)")
        text = _read_files(files, budget)
        source = f"Python {sysconfig.get_python_version()} standard library ({sysconfig.get_paths()['stdlib']})"
    else:
        p = Path(path)
        if not p.exists():
            raise DataError(f"--data {path}: no such file or folder")
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            text = _read_files(files, budget)
            if not text:
                raise DataError(f"--data {path}: the folder holds no readable text file")
        else:
            try:
                text = p.read_bytes()[: budget or None]
            except OSError as exc:
                raise DataError(f"--data {path}: cannot read it ({exc.strerror})") from None
            if not text:
                raise DataError(f"--data {path}: the file is empty")
            if not _is_text(text[:4096]):
                raise DataError(f"--data {path}: not a text file (it holds NUL bytes)")
        source = str(p)
    need = 20 * (seq_len + 1)  # the 10% held out must hold at least two windows
    if len(text) < need:
        raise DataError(f"--data {path}: {len(text)} bytes of text; need at least {need} "
                        f"(20 windows of --seq-len {seq_len} + 1)")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    # every 10th block is held out, so validation text comes from the same mix of files as training
    block = max(seq_len + 1, min(_BLOCK, data.numel() // 20))
    blocks = list(data.split(block))
    val = torch.cat(blocks[9::10])
    train = torch.cat([b for i, b in enumerate(blocks) if i % 10 != 9])
    return Corpus(source=source, train=train, val=val)

