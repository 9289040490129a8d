"""Token-bucket rate limits, keyed (per principal, per tool). Sans-io: the clock is passed in.

A bucket holds at most ``capacity`` tokens and refills at ``per_s`` tokens a second; a request
takes one (a legacy JSON-RPC batch one per message). When none is left the caller learns how long
until one will be, to tell the client exactly when to retry. Buckets are created lazily and the least recently used are forgotten past
``max_keys`` (a forgotten bucket comes back full, which only ever errs towards allowing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from runtime.http_config import RateLimit


class Bucket:
    __slots__ = ("capacity", "per_s", "stamp", "tokens")

    def __init__(self, limit: RateLimit, now: float) -> None:
        self.per_s = limit.per_s
        self.capacity = limit.capacity
        self.tokens = self.capacity
        self.stamp = now


class RateLimiter:
    """Buckets keyed by anything hashable, each with the limit given on first use."""

    def __init__(self, max_keys: int = 100_000) -> None:
        self._buckets: OrderedDict[Hashable, Bucket] = OrderedDict()
        self.max_keys = max_keys

    def take(self, key: Hashable, limit: RateLimit, now: float, count: float = 1.0) -> float:
        """Take ``count`` tokens (all or none): 0.0 if allowed, else the seconds until they are there.
        ``count`` must not exceed the bucket's capacity (the caller refuses what never could fit)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = Bucket(limit, now)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        # Take one token: 0.0 if allowed, else the seconds until one is available. (Written here,
        # not as a Bucket method: two limits are taken on every HTTP call.)
        elapsed = now - bucket.stamp
        if elapsed > 0:
            bucket.tokens = min(bucket.capacity, bucket.tokens + elapsed * bucket.per_s)
            bucket.stamp = now
        if bucket.tokens >= count:
            bucket.tokens -= count
            return 0.0
        return (count - bucket.tokens) / bucket.per_s

    def __len__(self) -> int:
        return len(self._buckets)
