"""A slow reward for tests/cluster/test_multiprocess.py: each call takes a second, so process 0 of a
run is still waiting for its next batch when a test signals another process."""

from __future__ import annotations

import time


def slow_copy_match(prompt, completion, answer="", **fields):
    """Share of the answer's characters the completion has in place, after a one-second sleep."""
    time.sleep(1.0)
    return sum(a == c for a, c in zip(answer, completion.strip())) / max(len(answer), 1)
