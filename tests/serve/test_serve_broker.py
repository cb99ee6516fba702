"""Unit tests of hpcpipe.serve.broker: the thread-safe channel between the HTTP loop and the engine thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hpcpipe.serve.broker import Broker, Closed, Event, QueueFull, Request
from hpcpipe.serve.sampling import SamplingParams


def req(rid: str, n: int = 3) -> Request:
    return Request(rid, [1, 2, 3], n, SamplingParams(), 0.0)


def test_submit_take_deliver_in_order_and_final_event_frees_capacity():
    b, seen = Broker(2), []
    b.submit([req("a"), req("b")], seen.append)
    assert b.outstanding == 2
    new, cancelled = b.take()
    assert [r.id for r in new] == ["a", "b"] and cancelled == []
    assert b.take() == ([], [])
    b.deliver([Event("a", [5], None), Event("b", [6], None), Event("a", [], "length")])
    assert [(e.request_id, e.tokens, e.finish) for e in seen] == [("a", [5], None), ("b", [6], None),
                                                                  ("a", [], "length")]
    assert b.outstanding == 1
    b.deliver([Event("a", [7], None)])             # after its final event: dropped
    assert len(seen) == 3
    b.submit([req("c")], seen.append)              # the freed place is usable again
    assert b.outstanding == 2


def test_submit_is_all_or_none():
    b = Broker(3)
    b.submit([req("a"), req("b")], lambda e: None)
    with pytest.raises(QueueFull, match="2 requests outstanding; capacity 3"):
        b.submit([req("c"), req("d")], lambda e: None)
    assert b.outstanding == 2
    assert [r.id for r in b.take()[0]] == ["a", "b"]
    b.submit([req("c")], lambda e: None)
    assert b.outstanding == 3


def test_reused_id_and_bad_capacity_and_bad_finish_are_refused():
    b = Broker(4)
    b.submit([req("a")], lambda e: None)
    with pytest.raises(ValueError, match="unique"):
        b.submit([req("a")], lambda e: None)
    with pytest.raises(ValueError, match="unique"):
        b.submit([req("x"), req("x")], lambda e: None)
    assert b.outstanding == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="capacity"):
            Broker(bad)
    b.take()
    with pytest.raises(ValueError, match="finish"):
        b.deliver([Event("a", [], "stopped")])


def test_cancel_before_take_never_reaches_the_engine():
    b = Broker(2)
    b.submit([req("a"), req("b")], lambda e: None)
    b.cancel("a")
    assert b.outstanding == 1
    new, cancelled = b.take()
    assert [r.id for r in new] == ["b"] and cancelled == []


def test_cancel_after_take_goes_to_the_engine_once_and_silences_the_sink():
    b, seen = Broker(2), []
    b.submit([req("a")], seen.append)
    b.take()
    b.cancel("a")
    b.cancel("a")
    b.cancel("unknown")
    b.deliver([Event("a", [1], None)])             # an event racing the cancel is dropped
    assert seen == []
    assert b.outstanding == 1                      # the engine still holds the slot until it takes the cancel
    assert b.take() == ([], ["a"])
    assert b.outstanding == 0
    b.deliver([Event("a", [], "cancelled")])       # harmless
    assert seen == [] and b.take() == ([], [])


def test_close_refuses_new_requests_and_lets_outstanding_finish():
    b, seen = Broker(2), []
    b.submit([req("a")], seen.append)
    b.close("draining")
    b.close("second reason ignored")
    assert b.closed == "draining"
    with pytest.raises(Closed, match="draining"):
        b.submit([req("b")], seen.append)
    b.take()
    b.deliver([Event("a", [9], "length")])
    assert seen[0].tokens == [9] and b.outstanding == 0


def test_queue_depth_is_outstanding_minus_running():
    b = Broker(8)
    b.submit([req(str(i)) for i in range(5)], lambda e: None)
    b.take()
    b.set_running(3)
    assert (b.outstanding, b.running, b.queue_depth) == (5, 3, 2)


def test_sink_runs_on_the_submitting_event_loop_thread():
    b = Broker(2)
    result = {}

    async def main():
        loop_thread = threading.get_ident()
        got = asyncio.Event()

        def sink(ev):
            result["thread"] = threading.get_ident()
            result["loop_thread"] = loop_thread
            got.set()                              # only legal on the loop's thread
        b.submit([req("a")], sink)

        def engine():
            b.take()
            b.deliver([Event("a", [1], "length")])
        t = threading.Thread(target=engine)
        t.start()
        await asyncio.wait_for(got.wait(), 5)
        t.join()

    asyncio.run(main())
    assert result["thread"] == result["loop_thread"]


def test_deliver_to_a_closed_loop_is_dropped_quietly():
    b = Broker(1)

    async def main():
        b.submit([req("a")], lambda e: None)
    asyncio.run(main())                            # the loop is closed afterwards
    b.take()
    b.deliver([Event("a", [1], None), Event("a", [], "length")])
    assert b.outstanding == 0


def test_threads_hammering_the_broker_keep_the_count_exact():
    b, done = Broker(16), []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k):
        for j in range(200):
            while True:
                try:
                    b.submit([req(f"{k}-{j}")], lambda e: (lock.acquire(), done.append(e), lock.release()))
                    break
                except QueueFull:
                    pass
            if j % 7 == 0:
                b.cancel(f"{k}-{j}")

    def engine():
        live = set()
        while not stop.is_set() or b.outstanding:
            new, cancelled = b.take()
            live |= {r.id for r in new}
            live -= set(cancelled)
            b.deliver([Event(i, [1], "length") for i in live])
            live.clear()

    eng = threading.Thread(target=engine)
    eng.start()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    stop.set()
    eng.join(10)
    assert not eng.is_alive() and b.outstanding == 0
    assert len(done) == len({e.request_id for e in done}) <= 800
    assert len(done) >= 800 - 4 * 29              # only the cancelled ones may be missing


def test_close_from_a_signal_handler_while_the_engine_holds_the_lock_does_not_deadlock():
    b = Broker(1)
    finished = threading.Event()

    def engine_thread_interrupted_inside_take():
        with b._lock:                              # where a signal may interrupt the engine's thread
            b.close("SIGTERM")                     # what a SIGTERM handler would call
        finished.set()
    t = threading.Thread(target=engine_thread_interrupted_inside_take, daemon=True)
    t.start()
    assert finished.wait(2), "close() deadlocked against the lock its own thread holds"
    assert b.closed == "SIGTERM"


def test_running_is_settled_when_a_final_event_ends_a_request_before_the_engine_reports_again():
    """CI once read running_sequences 2 right after both responses: the engine's next report had not come yet."""
    b = Broker(4)
    b.submit([req("a"), req("b"), req("c")], lambda e: None)
    b.take()
    b.set_running(3)
    assert (b.running, b.queue_depth) == (3, 0)
    b.deliver([Event("a", [1], "length"), Event("b", [1], "stop")])
    assert (b.running, b.queue_depth) == (1, 0)        # before any set_running: settled with the responses
    b.cancel("c")
    b.take()
    assert (b.running, b.queue_depth, b.outstanding) == (0, 0, 0)
    b.submit([req("d")], lambda e: None)               # waiting, not taken: never counted as running
    b.set_running(1)
    assert (b.running, b.queue_depth) == (0, 1)


def test_a_request_without_a_prompt_is_refused_at_submit():
    """It could never start: it held its place until the watchdog aborted the server (issue 40, item 1)."""
    b = Broker(4)
    with pytest.raises(ValueError, match="broker: request e has an empty prompt"):
        b.submit([req("a"), Request("e", [], 3, SamplingParams(), 0.0)], lambda e: None)
    assert b.outstanding == 0


def test_a_broker_that_is_not_ready_says_so_until_set_ready():
    b = Broker(2, ready=False)
    assert not b.ready
    b.set_ready()
    assert b.ready and Broker(2).ready


def test_a_cancelled_request_leaves_the_running_count_before_the_engine_frees_it():
    """A stop string ends a response right after its cancel: the gauge must not count it until the next take."""
    b = Broker(4)
    b.submit([req("a"), req("b"), req("c")], lambda e: None)
    b.take()
    b.set_running(2)                                   # c taken, not admitted yet
    b.cancel("a")
    assert (b.running, b.queue_depth) == (1, 1)
    b.take()                                           # handed over: the engine frees it and reports
    b.set_running(1)
    assert (b.running, b.queue_depth, b.outstanding) == (1, 1, 2)
