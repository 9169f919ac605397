"""Loop of ``bench.overhead.instructions``: TraceML's hooks as a training step calls them.

argv[1]: ``traced`` (each step inside ``trace_step``) or ``idle`` (the same hook
calls outside a step, what an untraced step pays); argv[2]: steps; argv[3] ``inline``
(optional): the step's items built on the training thread, as with a sink given to
``init``, instead of left to the sender's thread as ``init``'s own sender does
(``StepTimer.defer``). torch is kept out (``sys.modules["torch"] = None``), so only
TraceML's own work is counted. What the training thread runs is counted, not what the
sender's thread would: every 256 steps the loop empties the queues and hands the
ended steps' phase dicts back to the timer, zeroed, without building their items.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

sys.modules["torch"] = None  # type: ignore[assignment]

import traceml_ai as traceml  # noqa: E402
from traceml_ai.rank._patches import phase_hooks  # noqa: E402
from traceml_ai.rank._timing import event_names  # noqa: E402
from traceml_ai.transport.sender import RankSender  # noqa: E402


class Model:
    """Stands for a module: no tensors (device ``cpu``), no hook registration."""

    def parameters(self) -> Iterator[Any]:
        return iter(())

    def buffers(self) -> Iterator[Any]:
        return iter(())


def _autograd_backward() -> None:
    return None


def main() -> None:
    kind, steps = sys.argv[1], int(sys.argv[2])
    inline = len(sys.argv) > 3 and sys.argv[3] == "inline"
    model = Model()
    # Never connected and never started: put() queues as in a run; the queues are
    # emptied every 256 steps, as the sender thread would.
    sender = RankSender(("127.0.0.1", 1), "t", {"rank": 0}, max_pending_items=10**8)
    traceml.init(sink=sender, sampler_interval=3600)
    timer = phase_hooks.active()
    assert timer is not None
    # A sink given to init builds inline; init's own sender would set this.
    timer.defer = not inline
    autograd_backward = phase_hooks._timed_backward(_autograd_backward)
    if hasattr(timer, "_spare_acc"):
        # Tensor.backward itself is not wrapped: it calls torch.autograd.backward.
        tensor_backward: Any = lambda: autograd_backward()  # noqa: E731
    else:  # a tree from before: both were wrapped
        tensor_backward = phase_hooks._timed_backward(lambda: autograd_backward())
    queues = [queue for _, queue in sender._streams]

    def hooks() -> None:
        phase_hooks._forward_pre_hook(model, ())
        phase_hooks._forward_hook(model, (), None)
        tensor_backward()
        phase_hooks._optimizer_pre_hook(None, (), {})
        phase_hooks._optimizer_post_hook(None, (), {})

    for i in range(steps):
        timer.add_host(event_names.DATALOADER_NEXT, 1000)  # the DataLoader patch's call
        if kind == "traced":
            with traceml.trace_step(model):
                hooks()
        else:
            hooks()
        if i % 256 == 0:
            for queue in queues:
                queue.clear()
            ended = getattr(timer, "_ended", ())  # none in a tree from before defer
            while ended:
                if hasattr(timer, "_spare_acc"):  # the builder's reuse, without the items
                    acc = ended.popleft()
                    timer._ended_at.popleft()
                    for phase in acc.values():
                        phase.cpu_ns = phase.n_calls = 0
                    timer._spare_acc.append(acc)
                else:  # a tree from before: phases went back one by one
                    timer._spare.extend(p for p in ended.popleft()[3].values() if p.missing)
    traceml.shutdown()


if __name__ == "__main__":
    main()
