"""SimpleDataQueue: bound, FIFO order, timeouts, close waking blocked put and get, counters."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from asyncrl.rollout.queue import QueueClosed, SimpleDataQueue

pytestmark = pytest.mark.timeout(20)


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_fifo_bound_and_counters():
    q = SimpleDataQueue(capacity=2)
    q.put("a")
    q.put("b", timeout=0.01)
    with pytest.raises(queue.Full):
        q.put("c", timeout=0.02)
    assert q.qsize() == 2
    assert q.get() == "a" and q.get(timeout=0.01) == "b"
    with pytest.raises(queue.Empty):
        q.get(timeout=0.02)
    assert q.stats() == {"depth": 0, "capacity": 2, "total_put": 2, "total_got": 2}
    with pytest.raises(ValueError, match="capacity"):
        SimpleDataQueue(0)


def test_timeouts_wait_about_as_long_as_asked():
    q = SimpleDataQueue(1)
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)
    assert 0.09 <= time.monotonic() - start < 1.0


def test_close_wakes_a_blocked_get():
    q = SimpleDataQueue(1)
    thread, box = _in_thread(lambda: q.get())  # no timeout: only close can wake it
    time.sleep(0.05)
    assert thread.is_alive()
    q.close()
    thread.join(2)
    assert not thread.is_alive() and isinstance(box["error"], QueueClosed)


def test_close_wakes_a_blocked_put_and_refuses_later_puts():
    q = SimpleDataQueue(1)
    q.put(1)
    thread, box = _in_thread(lambda: q.put(2))
    time.sleep(0.05)
    assert thread.is_alive()
    q.close()
    thread.join(2)
    assert not thread.is_alive() and isinstance(box["error"], QueueClosed)
    with pytest.raises(QueueClosed):
        q.put(3, timeout=1)
    assert q.closed
    assert q.get() == 1  # what was queued can still be drained
    with pytest.raises(QueueClosed):
        q.get(timeout=1)


def test_a_put_wakes_a_waiting_get_and_get_all_drains():
    q = SimpleDataQueue(4)
    thread, box = _in_thread(lambda: q.get(timeout=5))
    time.sleep(0.02)
    q.put("x")
    thread.join(2)
    assert box["value"] == "x"
    q.put(1), q.put(2)
    assert q.get_all() == [1, 2] and q.get_all() == []


def test_many_producers_and_consumers_lose_nothing():
    q = SimpleDataQueue(3)
    got, lock = [], threading.Lock()

    def produce(base):
        for i in range(200):
            q.put(base + i, timeout=5)

    def consume():
        while True:
            try:
                item = q.get(timeout=5)
            except QueueClosed:
                return
            with lock:
                got.append(item)

    producers = [threading.Thread(target=produce, args=(k * 1000,), daemon=True) for k in range(3)]
    consumers = [threading.Thread(target=consume, daemon=True) for _ in range(2)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(10)
    while q.qsize():
        time.sleep(0.005)
    q.close()
    for t in consumers:
        t.join(5)
    assert sorted(got) == sorted(k * 1000 + i for k in range(3) for i in range(200))
