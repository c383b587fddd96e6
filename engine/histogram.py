"""A fixed-bucket histogram a worker keeps and reports in its stats, so the API process
can export it as a Prometheus histogram summed over workers.

    stats("kv_transfer_seconds") -> {"kv_transfer_seconds_bucket/0.01": cumulative count,
                                     ..., "kv_transfer_seconds_sum": s,
                                     "kv_transfer_seconds_count": n}
"""
from __future__ import annotations

import bisect

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket (not cumulative)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def stats(self, name: str) -> dict[str, float]:
        out, cum = {}, 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            out[f"{name}_bucket/{le}"] = cum
        out[f"{name}_sum"] = self.sum
        out[f"{name}_count"] = self.count
        return out
