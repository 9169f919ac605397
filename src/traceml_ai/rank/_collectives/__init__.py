"""The collectives of each step: ``recorder`` (each step's collectives, by phase and
operation, into ``collectives`` items) and ``parallel_layout`` (this rank's place in
the job's parallel layout, and which dimension a process group spans)."""
