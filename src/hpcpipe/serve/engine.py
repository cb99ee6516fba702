"""Running a set-up generation or serving job on every rank (collective): set up, loop, stop together.

Roughly, on every rank::

    front end opened on rank 0 (HTTP bind / the one prompt)    agreed: a taken port is one message, exit 2
    load this stage's groups (+ tok_emb for a tied head)       agreed: a bad file is one message, exit 2
    build the KV-cached stage
    loop: each role's non-blocking step; sleep (20 us doubling to 1 ms) only when none did anything
    stop: rank 0 drains, stops every replica's head, heads stop their followers; final barrier

Any exception inside the loop ends the whole job (the command's abort path),
so a failing rank never leaves the others or an HTTP client hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpcpipe.nn.decode import DecodeStage
from hpcpipe.runtime.backend import select_backend
from hpcpipe.runtime.comm import Mailbox, Poller, barrier, gather_to_root, together
from hpcpipe.runtime.faults import fault_step
from hpcpipe.runtime.topology import make_topology
from hpcpipe.serve.dispatch import TAG_DRAIN, Controller, Dispatcher, Source
from hpcpipe.serve.roles import Follower, Head, SamplerTable
from hpcpipe.serve.scheduler import ReplicaScheduler
from hpcpipe.serve.setup import ServeSetup
from hpcpipe.state import collective as checkpoint_mpi

if TYPE_CHECKING:
    from mpi4py.MPI import Comm


def build_stage(setup: ServeSetup, pp_rank: int, backend: Any, world: Comm, poller: Poller) -> DecodeStage:
    """Load this rank's layer groups (collective, agreed) and return its KV-cached stage."""
    mine = setup.stage_ranges[pp_rank]
    holds_head = setup.shape.n_groups - 1 in mine
    needs_table = holds_head and setup.shape.tied and 0 not in mine
    indices = list(mine) + ([0] if needs_table else [])
    if setup.weights.kind == "hf" and 0 in mine and not holds_head:
        # the embedding is only gathered from here: keep a 16-bit table as it is stored (exact, half the bytes)
        setup.weights.half_embedding = True
    arrays = checkpoint_mpi.load(world, poller, setup.weights, indices, with_optimizer=False).arrays
    table = arrays.pop(0)["tok_emb"] if needs_table else None
    stage = None
    with together(world, poller, 1, lambda e: f"cannot build stage {pp_rank}: {type(e).__name__}: {e}"):
        stage = DecodeStage(setup.shape, mine, arrays, backend.xp, setup.config.model.dtype,
                            setup.config.serve.max_sequences, tok_emb=table)
    return stage


def loop(steps: list[Callable[[], bool]], done: Callable[[], bool], poller: Poller) -> None:
    """Run the steps round after round until done(); sleep with a doubling pause while none does anything."""
    delay = poller.min_s
    while not done():
        busy = False
        for step in steps:
            busy = step() or busy
        if busy:
            delay = poller.min_s
        else:
            time.sleep(delay)
            delay = min(delay * 2.0, poller.max_s)


def run(setup: ServeSetup, world: Comm, open_source: Callable[[], Source], stop: Any,
        ready: Callable[[], None] | None = None, closing: Callable[[], None] | None = None) -> dict[str, Any]:
    """Serve on every rank of world until rank 0's source drains; return the counts on rank 0, {} elsewhere.

    ``open_source`` runs on world rank 0 only, inside an agreement (an error there is
    every rank's error); ``stop`` is the rank's StopSignals; ``ready`` runs on rank 0 once
    every rank has loaded its stage, ``closing`` on rank 0 once the requests have drained
    (before the final barrier, so that every rank leaves at the same time: a launcher that
    forwarded a SIGTERM kills the ranks still running when the first one exits).
    """
    cfg = setup.config
    poller = Poller(cfg.run.poll_min_us, cfg.run.poll_max_us)
    topo = make_topology(world, setup.dp, setup.pp)
    rank = world.Get_rank()
    source = None
    with together(world, poller, 2):
        if rank == 0:
            source = open_source()
    backend = select_backend(cfg.run.backend)
    stage = build_stage(setup, topo.pp_rank, backend, world, poller)
    pp_box, world_box = Mailbox(topo.pp_comm, backend, poller), Mailbox(world, backend, poller)
    samplers = SamplerTable(backend.to_host, setup.tokenizer.vocab_size)
    barrier(world, poller)
    if rank == 0 and ready is not None:
        ready()
    t0 = time.perf_counter()
    tokens, reason = 0, ""
    relay = SignalRelay(stop, world_box)
    if topo.pp_rank > 0:
        follower = Follower(stage, pp_box, topo.pp_rank, setup.pp, samplers)
        follower.fault_at = fault_step(rank)
        loop([follower.step, relay], lambda: follower.done, poller)
    else:
        scheduler = ReplicaScheduler(cfg.serve.max_sequences, setup.groups, setup.shape.seq_len, cfg.serve.kv_cache,
                                     cfg.serve.prefill_tokens, setup.stop_ids)
        if rank == 0:
            dispatcher = Dispatcher(source, world_box, setup.dp, setup.pp, scheduler)
            head = Head(stage, scheduler, pp_box, setup.pp, backend.xp, samplers,
                        lambda events: dispatcher.deliver(0, events, scheduler.running))
            head.fault_at = fault_step(rank)

            def watch() -> bool:
                if stop.requested:
                    dispatcher.drain(stop.name)
                return False
            loop([dispatcher.step, head.step, watch], lambda: dispatcher.finished, poller)
            dispatcher.stop()
            reason = dispatcher.draining or "done"
            if closing is not None:
                closing()
        else:
            control = Controller(world_box, scheduler, topo.dp_rank)
            head = Head(stage, scheduler, pp_box, setup.pp, backend.xp, samplers, control.report)
            head.fault_at = fault_step(rank)
            loop([control.step, head.step, control.flush, relay],
                 lambda: control.finished, poller)
        head.stop()
        tokens = head.tokens_out
    world_box.flush()
    barrier(world, poller)
    elapsed = time.perf_counter() - t0
    topo.free()
    counts = gather_to_root(world, (tokens, stage.cache_bytes, relay.sent))
    if counts is None:
        return {}
    # every drain request must be received before MPI finalizes: an unmatched message left at rank 0
    # made MPICH's launcher kill a rank on the way out (exit 9) after a SIGTERM to mpiexec
    dispatcher.collect_drains(sum(sent for _, _, sent in counts))
    return {"tokens": sum(t for t, _, _ in counts), "seconds": elapsed, "reason": reason,
            "kv_cache_bytes": max(b for _, b, _ in counts)}


class SignalRelay:
    """A step that tells rank 0, once, that a stop signal arrived on this rank (rank 0 counts them at the end)."""

    def __init__(self, stop: Any, box: Mailbox):
        self.stop, self.box, self.sent = stop, box, 0

    def __call__(self) -> bool:
        """Post the drain request the first time the signal is seen; never counts as work."""
        if self.stop.requested and not self.sent:
            self.box.post(0, TAG_DRAIN, ("drain", self.stop.name))
            self.sent = 1
        return False
