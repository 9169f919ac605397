"""``python -m bench.scale`` (from the repository root): see ``cli``."""

from .cli import main

main()
