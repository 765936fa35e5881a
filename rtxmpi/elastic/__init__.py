"""Elasticity: pre-emption, failure detection, shrink-and-continue, replace, supervised restart.

See docs/elastic.md. Layer "elastic" (docs/design.md): above state, below observe.
"""
from .loop import (PHASES, POLICIES, Loop, configure, exit_after, grows, recovered_state, resizes,
                   run, shrinks, stop_request)
from .preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopRequest, requeue

__all__ = ["Loop", "configure", "run", "exit_after", "recovered_state", "shrinks", "grows", "resizes",
           "stop_request", "requeue", "StopRequest",
           "EXIT_PREEMPTED", "EXIT_INTERRUPTED", "PHASES", "POLICIES"]
