"""``python -m gpu_check`` (with scripts/ on PYTHONPATH): see gpu_check.driver."""

from __future__ import annotations

import sys

from .driver import main

sys.exit(main(sys.argv[1:]))
