"""The tp collectives' wait policy (runtime.prompt_wait, comm.Poller): polled without sleeping while within its
window, sleeping between polls after it, and the window learnt from the fastest earlier wait of that kind and size.

The requests are real MPI generalized requests, completed by a thread or from between two polls.
"""

from __future__ import annotations

import threading
import time

from mpi4py import MPI

from hpcpipe.runtime.comm import Poller
from hpcpipe.runtime.prompt_wait import MAX_LEARNT_S, PromptWait


def generalized_request() -> MPI.Grequest:
    """A request that completes when its Complete() is called (MPI_Grequest_start)."""
    def query(status):
        status.Set_source(MPI.UNDEFINED)
        status.Set_tag(MPI.UNDEFINED)
        status.Set_error(MPI.SUCCESS)
        status.Set_elements(MPI.BYTE, 0)
        status.Set_cancelled(False)
    return MPI.Grequest.Start(query, lambda: None, lambda completed: None)


class CountingPoller(Poller):
    """A Poller that counts its sleeps (between_polls runs before each) and completes a request at the n-th."""

    def __init__(self, request: MPI.Grequest | None = None, complete_at: int = 0):
        super().__init__(20.0, 1000.0)
        self.sleeps, self.request, self.complete_at = 0, request, complete_at

    def between_polls(self) -> None:
        """Count the sleep that follows; complete the request at the chosen one."""
        self.sleeps += 1
        if self.sleeps == self.complete_at:
            self.request.Complete()


def test_a_wait_within_its_window_polls_without_sleeping():
    request = generalized_request()
    poller = CountingPoller()
    start = time.perf_counter()
    threading.Timer(0.02, request.Complete).start()      # the collective's partner, 20 ms late
    poller.wait([request], 30.0)                          # a window far longer than that, even on a busy machine
    assert poller.sleeps == 0
    assert time.perf_counter() - start >= 0.019           # it returned once the partner came, not before


def test_a_wait_past_its_window_sleeps_between_polls_and_still_completes():
    request = generalized_request()
    poller = CountingPoller(request, complete_at=3)
    start = time.perf_counter()
    poller.wait([request], 0.001)           # the request completes only between polls: the waiter must sleep
    assert poller.sleeps == 3
    assert poller.waited_s >= 0.001
    assert time.perf_counter() - start >= 0.001 + 20e-6 + 40e-6    # the window, then two sleeps (20 us, 40 us)


def test_without_a_window_the_waiter_sleeps_from_the_first_poll():
    request = generalized_request()
    poller = CountingPoller(request, complete_at=1)
    poller.wait([request], 0.0)
    assert poller.sleeps == 1


def test_the_window_is_the_yield_time_plus_twice_the_fastest_earlier_wait_of_that_kind_and_size():
    prompt = PromptWait(Poller(), 0.0005)
    assert prompt.window(("reduce", 1 << 20)) == 0.0005          # nothing learnt yet
    prompt.record(("reduce", 1 << 20), 0.015)                     # a wait stretched by sleeping polls
    prompt.record(("reduce", 1 << 20), 0.0007)                    # the transfer once both ranks were there
    prompt.record(("reduce", 1 << 20), 0.004)                     # a late partner: not the transfer time
    assert abs(prompt.window(("reduce", 1 << 20)) - (0.0005 + 2 * 0.0007)) < 1e-12
    assert prompt.window(("reduce", 1 << 10)) == 0.0005           # another size learns on its own
    assert prompt.window(("gather", 1 << 20)) == 0.0005           # and another kind


def test_prompt_wait_learns_from_the_waits_it_makes():
    prompt = PromptWait(CountingPoller(), 0.0005)
    request = generalized_request()
    start = time.perf_counter()
    threading.Timer(0.01, request.Complete).start()
    prompt.wait([request], ("reduce", 64))
    took = time.perf_counter() - start          # from before the partner's timer: the wait took no longer
    assert 0.0 < prompt.fastest[("reduce", 64)] <= took
    assert prompt.window(("reduce", 64)) == 0.0005 + min(2 * prompt.fastest[("reduce", 64)], MAX_LEARNT_S)


def test_the_learnt_part_of_the_window_is_capped_so_oversubscribed_ranks_do_not_spin():
    prompt = PromptWait(Poller(), 0.0005)
    prompt.record(("reduce", 1 << 20), 0.030)       # 8 ranks on 2 cores: the fastest wait is a scheduling delay
    assert prompt.window(("reduce", 1 << 20)) == 0.0005 + MAX_LEARNT_S
    assert MAX_LEARNT_S <= 0.005


def test_expert_exchanges_learn_one_window_per_power_of_two_of_bytes():
    from hpcpipe.runtime.expert_comm import size_class

    assert [size_class(n) for n in (0, 1, 2, 3, 4096, 4097, 6000, 8192)] == [1, 1, 2, 4, 4096, 8192, 8192, 8192]
