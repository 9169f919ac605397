"""Integrations of TraceML with training frameworks.

Each integration lives in its own submodule and imports its framework only when that
submodule is imported, so ``import traceml_ai.integrations`` never needs an extra:

- :mod:`traceml_ai.integrations.ray`: Ray Train (``pip install 'traceml-ai[ray]'``).
- :mod:`traceml_ai.integrations.huggingface`: the Hugging Face ``Trainer``
  (``pip install 'traceml-ai[hf]'``).
- :mod:`traceml_ai.integrations.lightning`: PyTorch Lightning
  (``pip install 'traceml-ai[lightning]'``).
- :mod:`traceml_ai.integrations.accelerate`: Accelerate loops (``pip install 'traceml-ai[hf]'``).

Under ``traceml run`` the Hugging Face and Lightning Trainers need no code change
(``traceml_ai.launch.bootstrap``); see docs/integrations.md.
"""
