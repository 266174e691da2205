"""The runtime behind ``ZeroInfinityStrategy``: a coordinator over separate parts.

- :mod:`~zero_runtime.runtime.coordinator`: :class:`ZeroRuntime`, which wires the parts
  and decides when each runs (the step boundary's order);
- :mod:`~zero_runtime.runtime.clock`: the step clock (a step ends when every local
  replica has updated its shard);
- :mod:`~zero_runtime.runtime.accounting`: bytes per tier and holder, and placement;
- :mod:`~zero_runtime.runtime.postmortem`: the budget checks and the OOM post-mortem.

The telemetry collector and the summaries are in :mod:`zero_runtime.telemetry`
(``collector``, ``summaries``), the control-channel poller in :mod:`zero_runtime.control`,
the post-mortem's contract and advice in :mod:`zero_runtime.oom`.
"""

from zero_runtime.runtime.coordinator import RuntimeState, ZeroRuntime

__all__ = ["RuntimeState", "ZeroRuntime"]
