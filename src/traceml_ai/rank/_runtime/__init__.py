"""A started rank SDK: ``sdk`` (the process-wide state: ``init``, ``trace_step``,
``shutdown``), ``runtime`` (what one ``init`` starts: the step timer, the collectives'
recorder, the samplers and the sink, wired together), ``connect`` (the aggregator's
address, the sender, DataLoader workers told from ranks), ``summaries`` (``summary``,
``final_summary``) and ``tracker_runs`` (the experiment-tracker runs a script opens)."""
