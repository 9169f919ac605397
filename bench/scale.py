"""Aggregator at scale: N simulated ranks over the real transport and wire format.

The entry point of ``python bench/scale.py [options]``; the code is the ``bench/scale/``
package (see its ``cli`` module for the modes and the accounting). Run as a script,
this file's folder is first on ``sys.path``, where the package directory wins over
this module of the same name.
"""

from scale.cli import main

if __name__ == "__main__":
    main()
