"""Running a set-up generation or serving job on every rank (collective): set up, loop, stop together.

Roughly, on every rank::

    front end opened on rank 0 (HTTP bind / the one prompt)    agreed: a taken port is one message, exit 2
    load this stage's groups (+ tok_emb for a tied head)       agreed: a bad file is one message, exit 2
    build the KV-cached stage (with parallel.tp: this tp rank's part of it)
    probe forward through each replica                         agreed: weights that overflow, one message, exit 2
    loop: each role's non-blocking step; sleep (20 us doubling to 1 ms) only when none did anything;
          the watchdog fires when pending work has not moved for run.stall_timeout s (hpcpipe.serve.stall)
    stop: rank 0 drains, stops every replica's head, heads stop their followers; final barrier

With tensor parallelism the roles run on each stage's tp rank 0, whose stage hands every call to the
stage's other tp ranks (hpcpipe.serve.tp_stage); those only follow their tp rank 0 until it stops them.

Any exception inside the loop ends the whole job (the command's abort path),
so a failing rank never leaves the others or an HTTP client hanging.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpcpipe.errors import ConfigError
from hpcpipe.kernels.formats import inference_format
from hpcpipe.nn.core.decode import DecodeStage
from hpcpipe.nn.core.fused_stage import compiled_available
from hpcpipe.runtime.backend import select_backend
from hpcpipe.runtime.comm import Poller, abort, barrier, gather_to_root, together
from hpcpipe.runtime.expert_comm import ExpertGroup
from hpcpipe.runtime.faults import fault_step
from hpcpipe.runtime.mailbox import Mailbox
from hpcpipe.runtime.topology import Topology, make_topology
from hpcpipe.runtime.tp_group import TPGroup
from hpcpipe.runtime.watchdog import Watchdog
from hpcpipe.serve.dispatch import Controller, Dispatcher, Loopback, Source
from hpcpipe.serve.ep_lockstep import Lockstep
from hpcpipe.serve.probe import check_forward
from hpcpipe.serve.protocol import Drain, send
from hpcpipe.serve.roles import Follower, Head, SamplerTable
from hpcpipe.serve.scheduler import ReplicaScheduler
from hpcpipe.serve.setup import ServeSetup
from hpcpipe.serve.speculate import DraftProposer, NgramProposer
from hpcpipe.serve.stall import Heartbeat
from hpcpipe.serve.tp_stage import TPDriver, TPWorker
from hpcpipe.state import collective as checkpoint_mpi

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

STOP_GRACE_S = 20.0


def build_stage(setup: ServeSetup, topo: Topology, backend: Any, world: Comm, poller: Poller,
                tp: TPGroup | None = None, ep: ExpertGroup | None = None) -> DecodeStage:
    """Load this rank's layer groups (collective, agreed) and return its KV-cached stage (its tp part)."""
    pp_rank = topo.pp_rank
    mine = setup.stage_ranges[pp_rank]
    holds_head = setup.shape.n_groups - 1 in mine
    needs_table = holds_head and setup.shape.tied and 0 not in mine
    indices = list(mine) + ([0] if needs_table else [])
    # the embedding is only gathered from here: keep a 16-bit table as it is stored (exact, half the bytes)
    gathered_only = 0 in mine and not holds_head and tp is None
    fmt = inference_format(setup.config.model.weight_format,
                           ep is None and compiled_available(backend.xp, setup.config.model.dtype, tp, setup.model))
    weights = setup.weights.forward_only(setup.config.model.dtype, half_embedding=gathered_only,
                                         stored=fmt != "float32" and ep is None,
                                         quantize=fmt == "q8_0" and ep is None)
    # tensor parallelism: this rank reads only its parts of the tensors (hyperslabs); expert parallelism: its experts
    model = setup.model
    shards = (lambda i, names: model.shards(i, tp.size, tp.rank)) if tp is not None else \
        (lambda i, names: model.expert_shards(i, ep.size, ep.rank)) if ep is not None else None
    arrays = checkpoint_mpi.load(world, poller, weights, indices, with_optimizer=False, shards=shards).arrays
    table = arrays.pop(0)["tok_emb"] if needs_table else None
    stage = None
    with together(world, poller, 1, lambda e: f"cannot build stage {pp_rank}: {type(e).__name__}: {e}"):
        srv = setup.config.serve
        stage = DecodeStage(model, mine, arrays, backend.xp, setup.config.model.dtype, srv.max_sequences,
                            tok_emb=table, tp=tp, weight_format=fmt, release=True, kv_block=srv.kv_block,
                            kv_blocks=setup.kv_blocks, ep=ep, kv_ring=setup.kv_ring)
    return stage


def build_proposer(setup: ServeSetup, backend: Any, vocab: int) -> Any:
    """The head's speculation proposer (serve.speculate): prompt lookup, a draft model read here whole, or None."""
    srv = setup.config.serve
    if srv.speculate == "ngram":
        return NgramProposer()
    if srv.speculate != "draft":
        return None
    draft = setup.draft
    source = draft.weights.forward_only(setup.config.model.dtype)
    arrays = source.read(list(range(draft.shape.n_groups)))
    stage = DecodeStage(draft.model, range(draft.shape.n_groups), arrays, backend.xp, setup.config.model.dtype,
                        srv.max_sequences, release=True, kv_block=srv.kv_block, kv_blocks=setup.kv_blocks)
    return DraftProposer(stage, vocab)


TP_YIELD_S = 0.005      # a tp worker polls by yielding this long after its last call before it sleeps


def loop(steps: list[Callable[[], bool]], done: Callable[[], bool], poller: Poller, yield_s: float = 0.0) -> None:
    """Run the steps round after round until done(); sleep with a doubling pause while none does anything.

    ``yield_s``: for that long after the last work, give the core away between rounds (sched_yield) instead
    of sleeping: a tp rank's next call follows its last within a token's time, and a sleep would make the
    stage's first collective wait for the timer's slack.
    """
    delay = poller.min_s
    last = time.perf_counter()
    while not done():
        busy = False
        for step in steps:
            busy = step() or busy
        if busy:
            delay = poller.min_s
            last = time.perf_counter()
        elif time.perf_counter() - last < yield_s:
            os.sched_yield()
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
    topo = make_topology(world, setup.dp, setup.pp, setup.tp, cfg.parallel.ep)
    rank = world.Get_rank()
    source = None
    with together(world, poller, 2):
        if rank == 0:
            source = open_source()
    backend = select_backend(cfg.run.backend, tf32=cfg.run.tf32)
    if rank == 0:
        for note in backend.notes:
            print(f"hpcpipe: note: {note}", file=sys.stderr, flush=True)
    tp = TPGroup(topo.tp_comm, backend, poller) if setup.tp > 1 else None
    ep = ExpertGroup(topo.ep_comm, backend, poller) if topo.ep > 1 else None
    stage = build_stage(setup, topo, backend, world, poller, tp, ep)
    pp_box, world_box = Mailbox(topo.pp_comm, backend, poller), Loopback(Mailbox(world, backend, poller), rank)
    tokenizer = setup.tokenizer
    samplers = SamplerTable(backend.to_host, tokenizer.vocab_size, tokenizer)   # grammars need the tokenizer
    if rank == 0 and setup.shape.vocab > tokenizer.vocab_size:     # said once: the text would not say it
        print(f"hpcpipe: note: the model has {setup.shape.vocab} output ids, its tokenizer names "
              f"{tokenizer.vocab_size}: sampling (greedy too) draws from the first {tokenizer.vocab_size} only, so "
              f"the {setup.shape.vocab - tokenizer.vocab_size} ids no text maps to are never generated",
              file=sys.stderr, flush=True)
    # every tp rank of a stage runs the probe with the same tokens, each along its own pp link (SPMD)
    problem = check_forward(stage, pp_box, topo.pp_rank, setup.pp, backend.xp, backend.to_host, samplers.vocab,
                            poller.min_s)
    with together(world, poller, 2):
        if problem is not None:
            raise ConfigError(f"--weights {str(setup.weights.path)!r}: {problem}")
    barrier(world, poller)
    if rank == 0 and ready is not None:
        ready()
    watchdog = Watchdog(cfg.run.stall_timeout, lambda: topo.name, lambda code: abort(world, code)).start()
    watchdog.idle("serving: idle")
    t0 = time.perf_counter()
    tokens, reason = 0, ""
    relay = SignalRelay(stop, world_box)
    driver = None
    if tp is not None and topo.tp_rank == 0:
        stage = driver = TPDriver(stage, Mailbox(topo.tp_comm, backend, poller), tp, backend.xp)
    if tp is not None and topo.tp_rank > 0:
        worker = TPWorker(stage, Mailbox(topo.tp_comm, backend, poller), tp)
        worker.fault_at = fault_step(rank)
        # its tp rank 0 watches for both; between a request's tokens the next call comes within milliseconds
        loop([worker.step, relay], lambda: worker.done, poller, yield_s=TP_YIELD_S)
    elif topo.pp_rank > 0:
        follower = Follower(stage, pp_box, topo.pp_rank, setup.pp, samplers)
        follower.fault_at = fault_step(rank)
        beat = Heartbeat(watchdog, lambda: follower.pending, lambda: follower.progress_at,
                         f"serving: stage {topo.pp_rank} waits for its pipeline's work")
        loop([follower.step, relay, beat], lambda: follower.done, poller)
    else:
        srv = cfg.serve
        scheduler = ReplicaScheduler(srv.max_sequences, setup.groups, setup.shape.seq_len, srv.kv_cache,
                                     srv.prefill_tokens, setup.stop_ids, depth=setup.pp, kv_block=srv.kv_block,
                                     kv_blocks=setup.kv_blocks, prefix_cache=srv.prefix_cache,
                                     proposer=build_proposer(setup, backend, samplers.vocab),
                                     speculate_tokens=srv.speculate_tokens if srv.speculate else 0,
                                     window=setup.kv_window, ring=setup.ring_window, ring_span=setup.kv_ring)
        # expert parallelism: the heads of an ep group agree every step and leave together (serve.ep_lockstep)
        lockstep = Lockstep(ep, lambda: control.finished) if ep is not None else None
        head = Head(stage, scheduler, pp_box, setup.pp, backend.xp, samplers, lambda events: control.report(events),
                    lockstep)
        finished = (lambda: lockstep.done) if lockstep is not None else (lambda: control.finished)
        # rank 0 judges every replica (its own too) by its messages: one at least every sixteenth of the stall timeout
        beat_s = min(1.0, max(0.05, cfg.run.stall_timeout / 16)) if cfg.run.stall_timeout > 0 else 1.0
        control = Controller(world_box, scheduler, topo.dp_rank, lambda: head.progress_at, beat_s)
        head.fault_at = fault_step(rank)
        if rank == 0:
            dispatcher = Dispatcher(source, world_box, setup.dp, setup.pp, setup.tp)

            def watch() -> bool:
                if stop.requested:
                    dispatcher.drain(stop.name)
                return False
            beat = Heartbeat(watchdog, lambda: dispatcher.pending or head.pending, dispatcher.moved_at,
                             "serving: waiting for the replicas' tokens", source.progressed)
            # replica 0's control messages and events go to this rank itself (Loopback), each polled a step later
            loop([dispatcher.step, control.step, head.step, control.flush, watch, beat], finished, poller)
            reason = dispatcher.draining or "done"
            if closing is not None:
                closing()
        else:
            beat = Heartbeat(watchdog, lambda: head.pending, lambda: head.progress_at,
                             f"serving: replica {topo.dp_rank} waits for its pipeline")
            loop([control.step, head.step, control.flush, relay, beat], finished, poller)
        head.stop()
        tokens = head.tokens_out
    # leaving includes rank 0's HTTP shutdown (HttpServer.stop: up to 15 s): allowed for on top of the timeout
    watchdog.progressed("stopping: the final barrier (every rank leaves together)", time.monotonic() + STOP_GRACE_S)
    if driver is not None:
        driver.stop()
    world_box.flush()
    barrier(world, poller)
    watchdog.stop()
    elapsed = time.perf_counter() - t0
    topo.free()
    ep_s = ep.seconds if ep is not None else 0.0     # this rank's seconds in the experts' all-to-alls
    counts = gather_to_root(world, (tokens, stage.cache_bytes, relay.sent, ep_s))
    if counts is None:
        return {}
    # every drain request must be received before MPI finalizes: an unmatched message left at rank 0
    # made MPICH's launcher kill a rank on the way out (exit 9) after a SIGTERM to mpiexec
    dispatcher.collect_drains(sum(c[2] for c in counts))
    return {"tokens": sum(c[0] for c in counts), "seconds": elapsed, "reason": reason,
            "kv_cache_bytes": max(c[1] for c in counts), "ep_comm_s": max(c[3] for c in counts)}


class SignalRelay:
    """A step that tells rank 0, once, that a stop signal arrived on this rank (rank 0 counts them at the end)."""

    def __init__(self, stop: Any, box: Mailbox):
        self.stop, self.box, self.sent = stop, box, 0

    def __call__(self) -> bool:
        """Post the drain request the first time the signal is seen; never counts as work."""
        if self.stop.requested and not self.sent:
            send(self.box, 0, Drain(self.stop.name))
            self.sent = 1
        return False
