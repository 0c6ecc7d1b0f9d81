"""Exponential backoff, capped, for any number of failures in a row. Pure.

`base * 2 ** n` overflows a float at n = 1024 (a key failing every 300 s for 85 hours, a job preempted
1,024 times); past the cap the exponent no longer matters, so it stops growing there.
"""

from __future__ import annotations

import math


def exponential(base_s: float, max_s: float, failures: int) -> float:
    """`base_s * 2 ** failures`, at most `max_s` (0 failures: `base_s`)."""
    if base_s <= 0:
        return 0.0
    cap = max(0, math.ceil(math.log2(max(max_s / base_s, 1.0))))  # 2 ** cap * base_s >= max_s
    return float(min(max_s, base_s * 2 ** min(max(failures, 0), cap)))
