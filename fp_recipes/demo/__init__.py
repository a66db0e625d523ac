"""``python -m fp_recipes demo``: train a small GPT once per recipe and compare them.

A byte-level language model built from fp_recipes modules (``fp_recipes.demo.model``) trains on the
running Python's standard-library source (or ``--data PATH``) once per recipe, from identical
weights and batches. It prints a progress bar per run and a table (train/validation loss, gap to the
baseline, tokens/s, peak memory, GEMM path, fields set from the environment) and writes a PNG of
the loss curves and a JSON of every number into ``--out`` (default ``runs/<timestamp>/``).
"""

from .cli import main, run_demo

__all__ = ["main", "run_demo"]
