"""SimpleDataQueue: the bounded, thread-safe hand-off from rollout threads to the executor's ``next_batch``.

``put``/``get`` block on a condition variable (no busy-waiting) up to their timeout;
``close()`` wakes every waiter, which then raises :class:`QueueClosed`. Its capacity is at
least ``(η+1)·B`` groups, which the admission rule never exceeds, so a put blocks only
briefly, if ever.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Generic, Optional, TypeVar

Item = TypeVar("Item")

Empty = queue.Empty
Full = queue.Full


class QueueClosed(RuntimeError):
    """The queue was closed: no more puts; gets drain what is left, then raise this."""


class SimpleDataQueue(Generic[Item]):
    """A bounded FIFO with timeouts, a clear closed signal and counters.

    Args:
        capacity: most items held at once (>= 1).
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"SimpleDataQueue capacity must be >= 1 (given {capacity})")
        self.capacity = capacity
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        self.total_put = 0
        self.total_got = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def qsize(self) -> int:
        with self._lock:
            return len(self._items)

    def put(self, item: Item, timeout: Optional[float] = None) -> None:
        """Append ``item``; waits up to ``timeout`` s for room (None: until room or close).

        Raises :class:`queue.Full` on timeout and :class:`QueueClosed` once closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_full:
            while not self._closed and len(self._items) >= self.capacity:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Full(f"SimpleDataQueue full ({self.capacity} items) for {timeout} s")
                self._not_full.wait(remaining)
            if self._closed:
                raise QueueClosed("put on a closed SimpleDataQueue")
            self._items.append(item)
            self.total_put += 1
            self._not_empty.notify()

    def get(self, timeout: Optional[float] = None) -> Item:
        """Pop the oldest item; waits up to ``timeout`` s (None: until an item or close).

        Raises :class:`queue.Empty` on timeout and :class:`QueueClosed` once closed and empty.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_empty:
            while not self._items:
                if self._closed:
                    raise QueueClosed("get on a closed, empty SimpleDataQueue")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Empty(f"SimpleDataQueue empty for {timeout} s")
                self._not_empty.wait(remaining)
            item = self._items.popleft()
            self.total_got += 1
            self._not_full.notify()
            return item

    def get_all(self) -> list[Item]:
        """Pop every item now held, without waiting (may be empty, even when closed)."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self.total_got += len(items)
            self._not_full.notify_all()
            return items

    def close(self) -> None:
        """Refuse further puts and wake every waiter."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"depth": len(self._items), "capacity": self.capacity, "total_put": self.total_put, "total_got": self.total_got}
