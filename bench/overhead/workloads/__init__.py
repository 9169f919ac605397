"""The training scripts the overhead benches launch, each as its own process under
``traceml run`` (or plain ``python``, or valgrind): run as files, so their folder is
first on ``sys.path`` and they import ``update_clock`` by plain name."""
