"""Integrations of TraceML with training frameworks.

Each integration lives in its own submodule and imports its framework only when that
submodule is imported, so ``import traceml_ai.integrations`` never needs an extra:

- :mod:`traceml_ai.integrations.ray`: Ray Train (``pip install 'traceml-ai[ray]'``).
"""
