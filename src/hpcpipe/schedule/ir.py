"""Pipeline schedules as pure data: (pp, micro-batches, virtual stages) -> per-rank action lists.

A schedule says only which compute action each pipeline rank runs in which
order; :mod:`hpcpipe.schedule.lower` adds the communication and proves the result
deadlock-free, and the engine, the simulator and the tests all consume the
same lists. This module imports nothing but the standard library and NumPy.

Compute actions (the IR, after PyTorch's pipelining):

    F   forward of one micro-batch through one stage
    B   full backward (input gradient and weight gradient together)
    I   input-gradient half of a split backward (zero-bubble schedules)
    W   weight-gradient half of a split backward

Stages are global virtual-stage indices: with ``pp`` ranks and ``v`` virtual
stages per rank there are ``pp * v`` stages, cut into v chunks of pp
consecutive stages. Where a stage lives is the schedule's *placement*
(:data:`hpcpipe.schedule.registry.REGISTRY`, :class:`PipeShape`), passed explicitly to
lowering, engine, trainer and simulator:

    interleaved   stage s on rank s % pp (Megatron's; v = 1 is the plain pipeline)
    v             chunk c on ranks 0..pp-1 when c is even, pp-1..0 when c is odd:
                  with v = 2 rank r owns stages r and 2pp-1-r (ZB-V's V shape),
                  so the loss stage is on rank 0 and stage pp-1 hands its output
                  to stage pp locally on rank pp-1

Every schedule is defined once, as a :class:`Timeline`: NumPy arrays indexed
``[rank, tick]`` that place each rank's actions on a unit clock (one tick per
action) such that an action needing another rank's output sits at a later
tick than the action that produces it. The action lists are read off it
(:meth:`Timeline.actions`: each rank's actions in tick order); the vectorised
validator (:func:`hpcpipe.schedule.validate_timeline.validate_timeline`) and simulator
(:func:`hpcpipe.schedule.sweep.simulate_timeline`) use the arrays themselves, which
is what makes pp = 1024 x 8192 micro-batches (17 M actions) tractable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcpipe.errors import ScheduleError

COMPUTE_OPS = ("F", "B", "I", "W")
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
STEP_OPS = ("ALLREDUCE", "OPT_STEP")

F, B, I, W = range(4)      # op codes in Timeline.ops: indices into COMPUTE_OPS
IDLE = -1


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction of a rank's program: an op on (stage, micro-batch), with a peer rank for comm."""

    op: str
    stage: int = -1
    mb: int = -1
    peer: int = -1

    def __str__(self) -> str:
        if self.op in STEP_OPS:
            return self.op
        text = f"s{self.stage}{self.op}{self.mb}"
        return f"{text}@{self.peer}" if self.peer >= 0 else text


PLACEMENTS = ("interleaved", "v")


def _check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ScheduleError(f"unknown stage placement {placement!r} (known: {', '.join(PLACEMENTS)})")


def stage_rank(stage: int, pp: int, placement: str) -> int:
    """Return the pipeline rank that owns a global (virtual) stage under a placement."""
    _check_placement(placement)
    chunk, offset = divmod(stage, pp)
    if placement == "v" and chunk % 2:
        return pp - 1 - offset
    return offset


def chunk_stage(chunk, rank, pp: int, placement: str):
    """Return the global stage of a rank's chunk (ints or NumPy arrays): the inverse of :func:`stage_rank`."""
    _check_placement(placement)
    if placement == "interleaved":
        return chunk * pp + rank
    # odd chunks run back from rank pp - 1 to rank 0: offset pp - 1 - rank instead of rank
    return chunk * pp + rank + (chunk % 2) * (pp - 1 - 2 * rank)


def rank_stages(rank: int, pp: int, n_stages: int, placement: str) -> list[int]:
    """Return the global stages a pipeline rank owns, in chunk order."""
    if pp < 1 or n_stages % pp or not 0 <= rank < pp:
        raise ScheduleError(f"rank {rank} of pp {pp} with {n_stages} stages: stages must be a multiple of pp "
                            f"and 0 <= rank < pp")
    return [int(chunk_stage(c, rank, pp, placement)) for c in range(n_stages // pp)]


@dataclass(frozen=True)
class PipeShape:
    """The shape of one pipeline: ranks, stages, micro-batches per step, and which rank owns each stage.

    One value instead of loose (pp, n_stages, n_micro, placement) arguments: the
    placement has no default, so a V-placed schedule (ZB-V) can never be lowered,
    validated, simulated or executed as if it were interleaved.
    """

    pp: int
    n_stages: int
    n_micro: int
    placement: str

    def __post_init__(self) -> None:
        _check_placement(self.placement)
        for label, value in (("pp", self.pp), ("stages", self.n_stages), ("micro-batches", self.n_micro)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{label} must be a positive integer, got {value!r}")
        if self.n_stages % self.pp:
            raise ScheduleError(f"stages ({self.n_stages}) must be a multiple of pp ({self.pp})")

    @property
    def virtual(self) -> int:
        """Model chunks (virtual stages) per rank."""
        return self.n_stages // self.pp

    def stage_rank(self, stage: int) -> int:
        """Return the pipeline rank that owns a global stage."""
        return stage_rank(stage, self.pp, self.placement)

    def rank_stages(self, rank: int) -> list[int]:
        """Return the global stages a pipeline rank owns, in chunk order."""
        return rank_stages(rank, self.pp, self.n_stages, self.placement)


@dataclass(frozen=True, eq=False)
class Timeline:
    """A schedule as arrays: at tick t, rank r runs ``ops[r, t]`` on chunk ``chunk[r, t]``, micro-batch ``mb[r, t]``.

    The chunk's global stage is ``chunk_stage(chunk, r, pp, placement)``:
    ``chunk * pp + r`` for the interleaved placement.

    ``ops`` holds op codes (F, B, I, W = 0..3, the order of COMPUTE_OPS) or
    IDLE (-1); idle cells have chunk 0 and micro-batch 0. All three arrays
    have shape (pp, n_ticks) and are read-only; ``chunk`` is a broadcast view
    of zeros when ``virtual`` is 1. The ticks are a dependency order (every
    message's producer runs at an earlier tick than its consumer), not a
    prediction: the simulator puts the real costs on them.
    """

    name: str
    pp: int
    n_micro: int
    virtual: int
    ops: np.ndarray
    chunk: np.ndarray
    mb: np.ndarray
    placement: str

    def __post_init__(self) -> None:
        _check_placement(self.placement)
        for label, arr in (("ops", self.ops), ("chunk", self.chunk), ("mb", self.mb)):
            if arr.ndim != 2 or arr.shape[0] != self.pp or arr.shape != self.ops.shape:
                raise ScheduleError(f"{self.name} timeline: {label} has shape {arr.shape}, expected "
                                    f"(pp, ticks) = ({self.pp}, {self.ops.shape[-1]})")

    @property
    def n_stages(self) -> int:
        """Number of global stages, pp x virtual."""
        return self.pp * self.virtual

    @property
    def shape(self) -> PipeShape:
        """The pipeline this timeline schedules."""
        return PipeShape(self.pp, self.n_stages, self.n_micro, self.placement)

    @property
    def n_ticks(self) -> int:
        """Length of the unit-tick clock (idle ticks included)."""
        return self.ops.shape[1]

    def actions(self) -> list[list[Action]]:
        """Return every rank's compute actions in tick order (the Action-list form of the schedule)."""
        programs = []
        for r in range(self.pp):
            ticks = np.flatnonzero(self.ops[r] != IDLE)
            ops = self.ops[r, ticks].tolist()
            stages = chunk_stage(self.chunk[r, ticks].astype(np.int64), r, self.pp, self.placement).tolist()
            mbs = self.mb[r, ticks].tolist()
            programs.append([Action(COMPUTE_OPS[o], s, m) for o, s, m in zip(ops, stages, mbs, strict=True)])
        return programs


def _check_sizes(name: str, pp: int, n_micro: int, virtual: int) -> None:
    for label, value in (("pp", pp), ("micro-batches", n_micro), ("virtual stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be a positive integer, got {value!r}")


def _index_dtype(count: int) -> type:
    """Smallest signed integer type holding 0..count-1 (the grids are pp x ticks: 17 M cells at pp = 1024)."""
    for dtype in (np.int8, np.int16, np.int32):
        if count <= np.iinfo(dtype).max + 1:
            return dtype
    return np.int64


def _empty_grid(pp: int, n_micro: int, virtual: int, n_ticks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    ops = np.full((pp, n_ticks), IDLE, np.int8)
    mb = np.zeros((pp, n_ticks), _index_dtype(n_micro))
    chunk = np.zeros((pp, n_ticks), _index_dtype(virtual)) if virtual > 1 else None
    return ops, mb, chunk


def _timeline(name: str, pp: int, n_micro: int, virtual: int, ops: np.ndarray, mb: np.ndarray,
              chunk: np.ndarray | None, placement: str) -> Timeline:
    if chunk is None:
        chunk = np.broadcast_to(np.zeros((), np.int8), ops.shape)
    for arr in (ops, mb, chunk):
        arr.flags.writeable = False   # schedules are values: nobody downstream may edit one in place
    return Timeline(name, pp, n_micro, virtual, ops, chunk, mb, placement)
