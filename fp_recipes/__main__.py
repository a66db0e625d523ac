"""``python -m fp_recipes``: env | demo | bench | doctor (info). The commands live in ``fp_recipes.cli``."""

from __future__ import annotations

import sys

from fp_recipes.cli import main

if __name__ == "__main__":
    sys.exit(main())
