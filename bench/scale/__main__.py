"""``python -m bench.scale``: the same command as ``python bench/scale.py``."""

from .cli import main

main()
