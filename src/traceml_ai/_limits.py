"""Limits that more than one part of TraceML applies alike, named once."""

from __future__ import annotations

END_OF_RUN_SUMMARY_MAX_BYTES = 64 * 1024 * 1024
"""Export files larger than this get no automatic summary when the run ends: not at the
end of ``traceml run``, not with a Ray job's ``mode="summary"``, not for the trackers'
end-of-run figures. The summary reads every line; on a long run that would hold the
prompt (or the aggregator's finalization) back for minutes after training ended.
``traceml summary RUN_FOLDER`` gives it on demand."""
