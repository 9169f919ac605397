"""What TraceML costs a training rank: one benchmark per module, run from the repository
root as ``python -m bench.overhead.<name>``.

- ``step``: a hand-written CPU loop, traced against plain, paired (one step in 4
  traced) and with a frozen aggregator;
- ``frameworks``: Hugging Face ``Trainer`` and Lightning ``fit()`` under the zero-code
  attach, timed;
- ``lines``: the Python lines TraceML adds to a framework update (``sys.settrace``);
- ``sampled``: TraceML's share of a framework update's py-spy samples;
- ``instructions``: instructions per traced step on the training thread (callgrind);
- ``timer_cold``: each step-timer entry point with the caches evicted, and the sender
  thread's work per step;
- ``gpu_step_costs``: each CUDA call of a traced GPU step (run under ``traceml run``).

Shared: ``paired`` (the one-in-k cycle estimator, also the GPU check's),
``framework_runs`` (how a framework workload is launched), ``profile_share`` (reading
py-spy samples). ``workloads/`` holds the training scripts these benches launch as
processes (run as files, so each imports its siblings by plain name).
"""
