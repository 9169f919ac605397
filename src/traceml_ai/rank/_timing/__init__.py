"""The step timer: what each traced step measured, and its step_time/step_memory items.

``step_timer`` (:class:`StepTimer`, the step and phase contexts, the two small
interfaces the torch hooks and the collectives' recorder reach it through),
``timer_core`` (the one place that chooses the C core ``hotpath.c`` or its pure-Python
twin ``hotpath_py``; ``hotpath.pyi`` is the interface of both), ``step_recorder`` (the
sink in front of the sender: recent steps, ``--trace-max-steps``) and ``event_names``.
Nothing here imports torch, the patches or the collectives.
"""
