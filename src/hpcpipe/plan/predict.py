"""Predict one candidate plan from the profile: step time by the simulator, peak memory per rank by parts.

A candidate is a layout (dp, pp, tp), a schedule with its virtual stages, the
micro-batch count and size, and a stage cut. Its per-stage costs are the sums
of its layer groups' measured F, I, W and B at that micro-batch size; a
message costs the measured point-to-point time of the largest activation
crossing a cut; the step's end (gradient allreduce over dp, the tied
embedding's sum, the agreed norm and the optimizer update) is added to every
rank. The simulator (:func:`hpcpipe.schedule.event_sim.simulate_schedule`)
runs the schedule's own action lists on those costs.

Tensor parallelism (tp > 1) takes each action's compute as the profile measured
the group split over tp (its products at their split shapes, what a tp rank still
computes whole; the whole group's time / tp for a profile without them) and adds the
tp collectives on its critical path (:meth:`Predictor.tp_seconds`: a block's
two output sums forward and two input-gradient sums backward of its
(rows, T, d) activation, the embedding's lookup, the loss's row maximum and its one
sum of the denominators and target logits, the head's input gradient; an
MLP's row-parallel outputs and column-parallel input gradients), each at the
ring-allreduce time of the probe's polled nonblocking allreduce (what a tp
collective is; :meth:`CommModel.tp_allreduce`) over tp ranks, plus what a collective
in a real step costs beyond that (:attr:`Predictor.tp_extra_s`, from the engine
calibration's tp run: its ranks arrive apart and wait by polling). Parameters, gradients,
optimizer state and layer caches count 1/tp per rank (the replicated norms,
biases and residual streams are small beside them and not counted twice).

Expert parallelism (ep > 1, a mixture-of-experts model) leaves the measured compute as it is (a rank computes
its experts over the rows of its ep peers: the same products in total) and adds each sparse block's four
all-to-alls (rows out and results back, forward and backward) of its (rows, T, k, d) choices, (ep - 1) / ep of
them leaving the rank, at the probe's point-to-point time; a rank holds 1/ep of the experts, whose gradients
are averaged over dp / ep replicas.

On several nodes (:class:`hpcpipe.profiles.comm_model.Placement`) the messages and
collectives of an axis whose groups span nodes (tp, pp, dp, the world's step
decision) are costed with the link between nodes instead (the probe run across two
nodes), the others with the link within a node.

Memory per rank counts what the engine holds at its peak: the process's
baseline (interpreter, libraries, MPI, BLAS), parameters and gradients,
optimizer state, the stashed caches of as many micro-batches as the simulator
says each stage holds at once, the sent activations and gradients the
engine keeps until the step's end, one action's temporaries, the step's input
and target rows, the synthetic data set every rank builds, and 15 % of all but the
baseline for the heap's freed blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpcpipe.config import DECODERS, Config
from hpcpipe.nn.memory import ITEMSIZE, estimate_rank_bytes, expert_elements, state_bytes, trained_params
from hpcpipe.nn.partition import layer_ranges
from hpcpipe.nn.registry import model_def
from hpcpipe.profiles.comm_model import CommModel, Placement
from hpcpipe.profiles.profile import Profile
from hpcpipe.schedule.costs import Costs
from hpcpipe.schedule.event_sim import simulate_schedule
from hpcpipe.schedule.ir import rank_stages
from hpcpipe.schedule.registry import placement_of

MAX_SENDS_KEPT = 65    # PipeComm keeps up to 64 sends before it reaps finished ones
ALLOCATOR_SLACK = 0.15


@dataclass(frozen=True)
class Candidate:
    """One plan to predict: layout, schedule, micro-batching and stage cut (layer groups per stage)."""

    dp: int
    pp: int
    schedule: str
    virtual_stages: int
    micro_batches: int
    micro_batch_size: int
    stage_layers: tuple[int, ...]
    cut: str = "profile"        # how the cut was chosen: "profile" (measured costs) or "flops"
    tp: int = 1                 # tensor-parallel ranks per stage
    ep: int = 1                 # expert-parallel replicas (a mixture of experts' blocks split over them)


@dataclass
class Prediction:
    """What a candidate is predicted to do."""

    candidate: Candidate
    step_time_s: float
    bubble: float                    # idle share of the pipeline ranks before the step's end
    busy_max_s: float                # compute seconds of the busiest pipeline rank
    step_end_s: float                # allreduce, tied sum, norm agreement and optimizer update
    peak_bytes: int                  # the rank with the most
    memory: dict[str, int] = field(default_factory=dict)   # that rank's bytes by part
    samples_per_step: int = 0
    tokens_per_sample: int = 0

    @property
    def samples_per_s(self) -> float:
        """Samples (GPT: windows of seq_len tokens) per second."""
        return self.samples_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second (GPT), 0 for an MLP."""
        return self.samples_per_s * self.tokens_per_sample


class Predictor:
    """Predicts candidates of one config from one profile (caching what does not depend on the candidate)."""

    def __init__(self, config: Config, profile: Profile, cores: int | None = None,
                 placement: Placement | None = None):
        self.config, self.profile, self.cores = config, profile, cores
        self.placement = placement or Placement(profile.comm)     # default: every rank on one node
        self.model = model_def(config)
        self.itemsize = ITEMSIZE[config.model.dtype]
        self.recompute = config.train.recompute == "stage"
        self.data_bytes = estimate_rank_bytes(config, [range(config.n_layers)], 1, "interleaved").data
        self.tok_emb = math.prod(self.model.specs[0].shapes["tok_emb"]) if self.model.tied else 0
        # what trains of each group (LoRA: the adapters): gradients, the exchange, the update, the optimizer state
        self.trained = [trained_params(spec) for spec in self.model.specs]
        self.tp_extra_s = 0.0
        self.tp_extra_s = self._tp_extra()

    def _tp_extra(self) -> float:
        """Seconds a tp collective took in the calibration's tp run beyond the comm model's, on average (>= 0)."""
        run = self.profile.tensor
        if not run or not run.get("collectives"):
            return 0.0
        tp, rows = int(run["tp"]), int(run["rows"])
        modelled = sum(sum(self.tp_seconds(i, rows, tp)) for i in range(self.model.n_layers))
        return max(0.0, (float(run["collective_s"]) - modelled) / float(run["collectives"]))

    def _boundary_bytes(self, index: int, rows: int) -> int:
        shape, dtype = self.model.boundary(index, rows)
        return math.prod(shape) * (8 if dtype == "int64" else self.itemsize)

    def _target_bytes(self, rows: int) -> int:
        if self.model.kind in DECODERS:
            return rows * self.config.model.seq_len * 8          # int64 next-token ids
        return self._boundary_bytes(self.model.n_layers, rows)

    def stage_costs(self, ranges: list[range], rows: int, schedule: str = "1f1b",
                    tp: int = 1) -> dict[tuple[str, int], float]:
        """Per-(op, stage) seconds: the sums of the stage's layer groups (recompute adds a forward to I and B);
        at ``tp`` > 1 one tp rank's compute of them (without the collectives: :meth:`_split` adds those)."""
        per: dict[tuple[str, int], float] = {}
        piped = len(ranges) > 1

        def seconds(op: str, r: range) -> float:
            return sum(self.profile.seconds(op, i, rows, pipelined=piped, schedule=schedule, tp=tp) for i in r)

        for s, r in enumerate(ranges):
            f = seconds("F", r)
            extra = f if self.recompute else 0.0
            per[("F", s)] = f
            per[("I", s)] = seconds("I", r) + extra
            per[("W", s)] = seconds("W", r)
            per[("B", s)] = seconds("B", r) + extra
        return per

    def tp_seconds(self, index: int, rows: int, tp: int, link: CommModel | None = None) -> tuple[float, float]:
        """Seconds of layer group ``index``'s tp collectives per forward and per backward at ``rows`` (0 at tp 1).

        ``link``: the model of the tp group's link (default the profile's, within a node).
        """
        if tp == 1:
            return 0.0, 0.0
        comm = link or self.profile.comm

        def allreduce(nbytes: int, ranks: int) -> float:
            return comm.tp_allreduce(nbytes, ranks) + self.tp_extra_s

        if self.model.kind in DECODERS:
            cfg = self.config.model
            act = allreduce(rows * cfg.seq_len * cfg.d_model * self.itemsize, tp)
            if index == 0:
                return act, 0.0                        # the vocabulary-parallel lookup's sum
            if index == self.model.n_layers - 1:
                # the loss: each token's logit maximum, then one sum of its denominator and target logit; back:
                # the head's input gradient
                tokens = rows * cfg.seq_len
                return allreduce(tokens * self.itemsize, tp) + allreduce(2 * tokens * self.itemsize, tp), act
            return 2 * act, 2 * act
        dims = self.config.model.dims
        if index % 2:                                  # row-parallel: the output is summed
            return allreduce(rows * dims[index + 1] * self.itemsize, tp), 0.0
        # column-parallel: the input gradient is summed (none for the model's input)
        return 0.0, (allreduce(rows * dims[index] * self.itemsize, tp) if index else 0.0)

    def _split(self, per: dict[tuple[str, int], float], ranges: list[range], rows: int, tp: int,
               link: CommModel | None = None) -> dict[tuple[str, int], float]:
        """Per-stage costs at tp ranks: each action's split compute (``per``, :meth:`stage_costs` at tp) plus its
        stage's tp collectives."""
        if tp == 1:
            return per
        out = {}
        for s, r in enumerate(ranges):
            fwd = sum(self.tp_seconds(i, rows, tp, link)[0] for i in r)
            bwd = sum(self.tp_seconds(i, rows, tp, link)[1] for i in r) + (fwd if self.recompute else 0.0)
            for op, extra in (("F", fwd), ("I", bwd), ("B", bwd), ("W", 0.0)):
                out[(op, s)] = per[(op, s)] + extra
        return out

    def ep_seconds(self, index: int, rows: int, ep: int) -> float:
        """Seconds of one all-to-all of layer group ``index``'s routed rows at ``rows`` (0 without experts or ep)."""
        if ep == 1 or not expert_elements(self.model, index):
            return 0.0
        cfg = self.config.model
        leaving = rows * cfg.seq_len * cfg.experts_per_token * cfg.d_model * self.itemsize * (ep - 1) // ep
        return self.profile.comm.p2p(leaving) + self.profile.comm.allreduce(8 * cfg.n_experts, ep)

    def _exchange(self, per: dict[tuple[str, int], float], ranges: list[range], rows: int, ep: int
                  ) -> dict[tuple[str, int], float]:
        """Per-stage costs with the experts' all-to-alls: two a sparse block forward, two backward (I or B)."""
        if ep == 1:
            return per
        out = dict(per)
        for s, r in enumerate(ranges):
            two = 2 * sum(self.ep_seconds(i, rows, ep) for i in r)
            for op, extra in (("F", two), ("I", two + (two if self.recompute else 0.0)),
                              ("B", two + (two if self.recompute else 0.0))):
                out[(op, s)] = per[(op, s)] + extra
        return out

    def _rank_params(self, layers: list[int], trained: bool = False, ep: int = 1) -> int:
        # expert parallelism: 1/ep of every block's experts on a rank
        n = sum((self.trained[i] if trained else self.profile.params(i))
                - expert_elements(self.model, i) * (ep - 1) // ep for i in layers)
        if self.tok_emb and self.model.n_layers - 1 in layers and 0 not in layers:
            # a tied head away from the embedding holds its own copy of the table (trained unless frozen)
            n += self.tok_emb if not trained or self.trained[0] else 0
        return n

    def predict(self, c: Candidate) -> Prediction:
        """Simulate the candidate and count its memory."""
        ranges = layer_ranges(c.stage_layers)
        rows = c.micro_batch_size
        placement = placement_of(c.schedule)
        n_stages = c.pp * c.virtual_stages
        link = {axis: self.placement.link(axis, c.dp, c.pp, c.tp) for axis in ("dp", "pp", "tp", "world")}
        per = self._exchange(self._split(self.stage_costs(ranges, rows, c.schedule, c.tp), ranges, rows, c.tp,
                                         link["tp"]), ranges, rows, c.ep)
        cut_bytes = max((self._boundary_bytes(r.start, rows) for r in ranges[1:]), default=0)
        comm = link["pp"].p2p(cut_bytes) if c.pp > 1 else 0.0
        rank_layers = [[i for s in rank_stages(p, c.pp, n_stages, placement) for i in ranges[s]] for p in range(c.pp)]
        params = [-(-self._rank_params(layers, ep=c.ep) // c.tp) for layers in rank_layers]
        trained = [-(-self._rank_params(layers, True, c.ep) // c.tp) for layers in rank_layers]
        opt = self.profile.optimizer(self.config.train)
        tied_apart = bool(self.tok_emb) and bool(self.trained[0]) and \
            not any(0 in ls and self.model.n_layers - 1 in ls for ls in rank_layers)
        # ZeRO-1's reduce-scatter and allgather move what one allreduce does; each replica updates 1/dp
        updated = c.dp if self.config.train.zero else 1
        step_end = max(link["dp"].allreduce(n * self.itemsize, c.dp)
                       + (link["pp"].p2p(self.tok_emb * self.itemsize) if tied_apart else 0.0)
                       + opt["seconds_per_param"] * n / updated for n in trained)
        step_end += link["world"].allreduce(32, c.dp * c.pp * c.tp)      # the agreed step decision
        costs = Costs(comm=comm, step=step_end, per_stage=per)
        shared, costs = self._shared_cores(c, costs)
        result = simulate_schedule(c.schedule, c.pp, c.micro_batches, c.virtual_stages, costs, check=False,
                                   cores=shared, per_rank_costs=False, events=False)
        worst: dict[str, int] = {}
        for p in range(c.pp):
            mine = self._memory(c, ranges, rank_stages(p, c.pp, n_stages, placement), params[p],
                                result.peak_stashed_stage, cut_bytes, trained[p])
            if sum(mine.values()) > sum(worst.values()):
                worst = mine
        samples = c.dp * c.micro_batches * c.micro_batch_size
        tokens = self.config.model.seq_len if self.model.kind in DECODERS else 0
        # the pipeline's idle share before the step's end (which every rank spends the same way)
        phase = c.pp * (result.step_time - step_end)
        bubble = max(0.0, 1.0 - sum(result.busy) / phase) if phase > 0 else 0.0
        # replicas finish their compute apart and wait for the slowest at the allreduce (measured share)
        sync = self.profile.sync_share * max(result.busy) if c.dp > 1 else 0.0
        return Prediction(c, result.step_time + sync, bubble, max(result.busy), step_end, sum(worst.values()),
                          worst, samples, tokens)

    def _shared_cores(self, c: Candidate, costs: Costs) -> tuple[float | None, Costs]:
        """The cores one replica's pipeline computes on (None: one per rank), and its costs slowed to match.

        ``--cores`` is shared by all dp x pp x tp ranks; the replicas run alike, so each
        pipeline has cores / dp of them, and a stage of tp ranks needs tp cores to compute
        at its split speed: counted in stages, a pipeline has cores / (dp x tp). Below one
        a replica's every action runs that much slower (the simulator shares whole cores
        among its ranks).
        """
        if self.cores is None:
            return None, costs
        per_replica = self.cores / (c.dp * c.tp)
        if per_replica < 1:
            slow = 1.0 / per_replica
            costs = Costs(comm=costs.comm, step=costs.step * slow,
                          per_stage={key: seconds * slow for key, seconds in costs.per_stage.items()})
            return (1.0 if c.pp > 1 else None), costs
        return (per_replica if per_replica < c.pp else None), costs

    def _memory(self, c: Candidate, ranges: list[range], stages: list[int], n_params: int,
                peak_stage: dict[int, int], cut_bytes: int, n_trained: int) -> dict[str, int]:
        rows = c.micro_batch_size
        prof, opt = self.profile, self.profile.optimizer(self.config.train)
        layers = [i for s in stages for i in ranges[s]]
        if self.recompute:   # each held micro-batch keeps its stage input; one stage's caches are rebuilt at a time
            inputs = sum(peak_stage.get(s, 0) * self._boundary_bytes(ranges[s].start, rows) for s in stages)
            rebuilt = max(sum(prof.stash_bytes(i, rows) for i in ranges[s]) for s in stages) / c.tp
            stash = inputs + rebuilt
        else:
            stash = sum(peak_stage.get(s, 0) * sum(prof.stash_bytes(i, rows) for i in ranges[s])
                        for s in stages) / c.tp
        sends = min(2 * c.virtual_stages * c.micro_batches, MAX_SENDS_KEPT) * cut_bytes if c.pp > 1 else 0
        updated = -(-n_trained // c.dp) if self.config.train.zero else n_trained     # what this rank's update reads
        work = max(max(prof.work_bytes(i, rows) for i in layers) / c.tp, opt["work_bytes_per_param"] * updated * 1.0)
        if len(ranges) - 1 in stages:
            # the loss gradient (the model output's size) waits from each forward of the last stage to its backward
            stash += peak_stage.get(len(ranges) - 1, 0) * self._boundary_bytes(self.model.n_layers, rows)
        feed = 0
        if 0 in stages:
            feed += self._boundary_bytes(0, rows) * c.micro_batches
        if len(ranges) - 1 in stages:
            feed += self._target_bytes(rows) * c.micro_batches
        params, _ = state_bytes(n_params, n_trained, self.config.train, c.dp, self.itemsize)
        parts = {"baseline": prof.baseline_bytes,
                 "parameters": params,
                 "optimizer": int(opt["state_buffers"]) * updated * self.itemsize,
                 "activations": int(stash), "messages": int(sends), "workspace": int(work),
                 "batch": int(feed), "data": int(self.data_bytes)}
        # the heap keeps some freed blocks it cannot return (measured: up to ~10 % above the live arrays)
        parts["allocator"] = int(ALLOCATOR_SLACK * (sum(parts.values()) - parts["baseline"]))
        return parts
