"""How many bytes a model holds: per rank of a planned layout (parameters, optimizer, activations, data), per stash.

Arithmetic only, from the model's specs and the config: the training start-up
checks (:mod:`hpcpipe.train.preflight`) and the planner
(:mod:`hpcpipe.plan.predict`) both count with it, and the engine and the
layer profile measure stashes with :func:`cache_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcpipe.config import DECODERS, Config
from hpcpipe.nn.core.kv_pages import held_pages, mixed_window, sequence_window
from hpcpipe.nn.optim import make_optimizer
from hpcpipe.nn.registry import model_def, model_specs
from hpcpipe.schedule.ir import rank_stages

ITEMSIZE = {"float32": 4, "float64": 8}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs at most (the pipeline rank with the most), by what holds them."""

    parameters: int    # parameters and the trained ones' gradients (LoRA: the adapters'; ZeRO-1: + 1/dp block)
    optimizer: int     # optimizer state buffers (SGD momentum: 1, Adam(W): 2) of the trained ones (ZeRO-1: 1/dp)
    activations: int   # layer caches of every micro-batch held at once (an upper bound)
    data: int          # the synthetic data set, built on every rank

    @property
    def total(self) -> int:
        """All of it."""
        return self.parameters + self.optimizer + self.activations + self.data


def expert_elements(model: Any, index: int) -> int:
    """Elements of layer group ``index``'s experts (the tensors expert parallelism splits; 0 without experts)."""
    names = model.expert_shards(index, 1, 0)
    return sum(math.prod(model.specs[index].shapes[name]) for name in names)


def held_elements(model: Any, index: int, ep: int) -> int:
    """Elements of layer group ``index`` one rank holds at expert parallelism ``ep``: its experts / ep, the rest."""
    experts = expert_elements(model, index)
    return model.specs[index].n_params - experts + experts // ep


def trained_params(spec: Any) -> int:
    """Scalars of a layer group that train (all but LoRA's frozen base): they have gradients and optimizer state."""
    frozen = getattr(spec, "frozen", ())
    return sum(math.prod(shape) for name, shape in spec.shapes.items() if name not in frozen)


def state_bytes(n_params: int, n_trained: int, train: Any, dp: int, itemsize: int) -> tuple[int, int]:
    """(parameter and gradient bytes, optimizer state bytes) of a rank holding n_params scalars of which n_trained
    train: frozen ones without a gradient (LoRA), the state of 1/dp of the trained ones under train.zero = 1 (and
    that block of the averaged gradient besides)."""
    import numpy as np

    buffers = len(make_optimizer(train, np, 0, np.float32).state)
    share = -(-n_trained // dp) if train.zero else n_trained
    grads = n_trained + (share if train.zero else 0)
    return (n_params + grads) * itemsize, buffers * share * itemsize


def estimate_rank_bytes(config: Config, stage_ranges: list[range], pp: int, placement: str,
                        dp: int = 1) -> MemoryEstimate:
    """Return the largest per-rank memory need over the pipeline ranks of a planned layout (dp: its replicas,
    among which train.zero = 1 shards the optimizer state)."""
    specs = model_specs(config)
    model = model_def(config) if config.parallel.ep > 1 else None
    itemsize = ITEMSIZE[config.model.dtype]
    tr = config.train
    rows = tr.micro_batches * tr.micro_batch_size
    worst = MemoryEstimate(0, 0, 0, 0)
    for rank in range(pp):
        indices = [i for s in rank_stages(rank, pp, len(stage_ranges), placement) for i in stage_ranges[s]]
        layers = [specs[i] for i in indices]
        # expert parallelism: a rank holds (and trains) 1/ep of every block's experts
        unheld = [specs[i].n_params - held_elements(model, i, config.parallel.ep) if model else 0 for i in indices]
        params, optimizer = state_bytes(sum(s.n_params for s in layers) - sum(unheld),
                                        sum(trained_params(s) for s in layers) - sum(unheld), tr, dp, itemsize)
        # each layer's cache holds its input and what its activation saved (one row of each per
        # sample), and GPipe holds every micro-batch at once: an upper bound for every schedule
        widths = sum(s.act_elements for s in layers)
        mine = MemoryEstimate(params, optimizer, rows * widths * itemsize, 0)
        worst = max(worst, mine, key=lambda e: e.total)
    data = 0
    if not config.data.path and config.model.kind in DECODERS:   # int64 windows, x and y views of one stream
        data = config.data.synthetic_samples * (config.model.seq_len + 1) * 8 * 2
    elif not config.data.path:   # every rank draws the whole synthetic set (in float64 first)
        dims = config.model.dims
        data = config.data.synthetic_samples * (dims[0] + dims[-1]) * (8 + itemsize) + dims[0] * dims[-1] * 8
    return MemoryEstimate(worst.parameters, worst.optimizer, worst.activations, data)


def kv_window(config: Config, model: Any) -> int:
    """The sliding window under which a serving sequence gives back its KV blocks before it (every block of the
    model windowed; hpcpipe.serve.kv_ledger): 0 without a KV cache, or when a draft model shares the tables."""
    srv = config.serve
    return 0 if not srv.kv_cache or srv.speculate == "draft" else sequence_window(model)


def pool_pages(config: Config, model: Any) -> int:
    """KV blocks in each stage's pool: ``serve.kv_blocks``, else ``serve.max_sequences`` times the blocks one
    sequence holds at most (its whole context, or its window's: hpcpipe.nn.core.kv_pages.held_pages)."""
    srv = config.serve
    return srv.kv_blocks or srv.max_sequences * sequence_pages(config, model)


def sequence_pages(config: Config, model: Any) -> int:
    """KV blocks one serving sequence holds at most (hpcpipe.nn.core.kv_pages.held_pages)."""
    srv = config.serve
    ahead = srv.speculate_tokens if srv.speculate and srv.kv_cache else 0
    return held_pages(model.shape.seq_len, srv.kv_block, kv_window(config, model), ahead)


def ring_window(config: Config, model: Any) -> int:
    """The window of a model's windowed blocks when they keep their keys in per-slot rings beside full-attention
    blocks (hpcpipe.nn.core.kv_pages.ring_layout), or 0: no KV cache (every step recomputes the whole sequence),
    no such mix, or a ring as long as the context."""
    srv = config.serve
    window = mixed_window(model) if srv.kv_cache else 0
    return window if window and ring_pages_of(config, model, window) < -(-model.shape.seq_len // srv.kv_block) else 0


def ring_pages_of(config: Config, model: Any, window: int) -> int:
    """KV blocks of one slot's ring for a ``window``: its keys, the block it starts in, the block a new token
    opens, and what the items in flight write past the next token (the tokens a verified speculation writes, or
    a prompt's chunks of serve.prefill_tokens, up to pp of them at once), so that prompt chunks are neither cut
    shorter nor kept from following each other through the stages."""
    srv = config.serve
    ahead = max(srv.speculate_tokens if srv.speculate and srv.kv_cache else 0,
                srv.prefill_tokens * config.parallel.pp)
    return held_pages(model.shape.seq_len, srv.kv_block, window, ahead)


def ring_pages(config: Config, model: Any) -> int:
    """KV blocks of each slot's ring for the windowed blocks (:func:`ring_window`), 0 without rings."""
    window = ring_window(config, model)
    return ring_pages_of(config, model, window) if window else 0


def _kept_bytes(spec: Any, matrix_bytes: Callable[[tuple[int, ...]], float], itemsize: int) -> float:
    """A block's bytes with its matrices as ``matrix_bytes`` says and everything else (vectors) in the run's dtype."""
    return sum(math.prod(shape) * (matrix_bytes(shape) if len(shape) == 2 else itemsize)
               for shape in spec.shapes.values())


def decode_rank_bytes(config: Config, stage_ranges: list[range],
                      matrix_bytes: Callable[[tuple[int, ...]], float] | None = None) -> tuple[int, int]:
    """Return (parameters, KV cache) bytes of the largest pipeline rank of a generation or serving layout.

    ``matrix_bytes``: bytes per value of a block's (in, out) matrix of that shape as the stage keeps it
    (model.weight_format stored / q8_0: hpcpipe.serve.setup.format_bytes); None: the run's dtype, as float32
    keeps every parameter. Embeddings, the head and vectors are counted in the run's dtype either way.

    A rank holds its groups' parameters (and a tied head's copy of the embedding table) and,
    per block, keys and values of its KV-block pool (``serve.kv_blocks`` of ``serve.kv_block`` positions; 0:
    ``serve.max_sequences`` whole contexts of ``seq_len`` tokens, or their windows' blocks: :func:`pool_pages`); a
    windowed block beside full-attention blocks holds ``serve.max_sequences`` rings instead (:func:`ring_pages`). With
    tensor parallelism (parallel.tp) a rank holds about 1/tp of both: its heads' key/value heads
    (at least one) and its part of every matrix (norms are replicated but small). With expert parallelism
    (parallel.ep) a rank holds 1/ep of every block's experts.
    """
    model = model_def(config)
    specs, shape = model.specs, model.shape
    itemsize = ITEMSIZE[config.model.dtype]
    tp = config.parallel.tp
    kv_heads = -(-shape.n_kv_heads // tp)
    head_dim = shape.head_dim
    srv = config.serve
    pages = pool_pages(config, model)
    per_block = 2 * pages * srv.kv_block * kv_heads * head_dim * itemsize
    per_ring = 2 * srv.max_sequences * ring_pages(config, model) * srv.kv_block * kv_heads * head_dim * itemsize
    worst = (0, 0)
    for groups in stage_ranges:
        blocks = [i for i in groups if 1 <= i <= shape.n_blocks]
        params = sum(held_elements(model, i, config.parallel.ep) * itemsize for i in groups
                     if matrix_bytes is None or i not in blocks)
        if matrix_bytes is not None:
            params += sum(_kept_bytes(specs[i], matrix_bytes, itemsize) for i in blocks)
        if shape.tied and len(specs) - 1 in groups and 0 not in groups:
            params += specs[0].n_params * itemsize
        ringed = sum(1 for i in blocks if model.window(i) > 0) if per_ring else 0
        mine = (int(-(-params // tp)), (len(blocks) - ringed) * per_block + ringed * per_ring)
        worst = max(worst, mine, key=sum)
    return worst


def _address(array: Any) -> int:
    """Start address of an array's data (NumPy or CuPy)."""
    interface = getattr(array, "__array_interface__", None)
    return interface["data"][0] if interface is not None else array.data.ptr


def cache_bytes(caches: Any) -> int:
    """Bytes of the distinct arrays a stage keeps for its backward.

    An array and its views of the same memory (a layer's output is the next one's
    input, ``rows(u)`` is u) are counted once: keyed by start address and size.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    pending = [caches]
    while pending:
        obj = pending.pop()
        if isinstance(obj, (tuple, list)):
            pending.extend(obj)
        elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):
            key = (_address(obj), obj.nbytes)
            if key not in seen:
                seen.add(key)
                total += obj.nbytes
    return total
