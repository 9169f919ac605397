"""``python -m scripts.gpu_check`` from the repository root: see ``driver``."""

from __future__ import annotations

import sys

from .driver import main

sys.exit(main(sys.argv[1:]))
