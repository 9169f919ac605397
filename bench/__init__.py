"""TraceML's benchmarks: each prints figures and never passes or fails on time.

Run each from the repository root as a module, ``python -m bench.<name>``
(docs/benchmarks.md lists them with their figures):

- ``records``, ``export``, ``transport``, ``frames``, ``summary``: the records core,
  the export engine, the loopback transport, typed tables, ``traceml summary``;
- ``scale``: the aggregator under N simulated ranks (a package);
- ``overhead``: what TraceML costs a training rank (a package: ``overhead.step``,
  ``overhead.frameworks``, ... and the estimator they share, ``overhead.paired``,
  which the GPU check's judge imports too);
- ``bigfile``: not a bench, the realistic step_time export of any size the benches
  that read files write (``write_step_time``).
"""
