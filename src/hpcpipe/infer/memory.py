"""What one rank of a streamed inference holds, checked against its share of the node before any collective.

A stage keeps ``infer.buffers`` slot buffers on each side (received inputs, outputs
to send or write), each as large as the largest micro-batch a replica has, plus its
layers' parameters and a few arrays the width of a micro-batch (see
:mod:`hpcpipe.infer.stream`). Each slot also costs bookkeeping in Python and MPI:
two array objects, the views every layer's kernels use, one persistent request per
link. Measured on the development machine: about 0.75 KiB per slot, 0.4 KiB per
slot and layer and 1.05 KiB per slot and link; the constants below round them up.
Nothing else grows with the buffers, so a value such as 1e8 is refused here, with
the bytes it implies, instead of growing by gigabytes per rank before the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.nn.memory import ITEMSIZE
from hpcpipe.runtime.host_memory import rank_share
from hpcpipe.runtime.launcher import local_rank_count

SLOT_BYTES = 1024              # the two slot arrays' objects
SLOT_LAYER_BYTES = 512         # per slot, layer and row count: the views of one kernel call
SLOT_LINK_BYTES = 1280         # per slot and link: a persistent MPI request and its argument list


@dataclass(frozen=True)
class StageBytes:
    """Bytes one rank of a stage holds while streaming, by what holds them."""

    stage: int
    rows: int            # rows of the largest micro-batch (the slot buffers' height)
    in_width: int
    out_width: int
    buffers: int         # the slot buffers and their bookkeeping
    parameters: int      # the stage's layers in the model's dtype
    scratch: int         # between-layer arrays, repeated biases, GELU scratch

    @property
    def total(self) -> int:
        """All of it."""
        return self.buffers + self.parameters + self.scratch


def stage_bytes(config: Config, stage_ranges: list[range], stage: int, n_rows: int) -> StageBytes:
    """Return what one rank of ``stage`` holds for an input of ``n_rows`` rows (an upper bound over replicas)."""
    dims, model, slots = config.model.dims, config.model, config.infer.buffers
    batch = config.infer.micro_batch_size
    itemsize = ITEMSIZE[model.dtype]
    layers = stage_ranges[stage]
    rows = min(batch, n_rows)
    row_counts = 2 if 0 < n_rows % batch < rows else 1
    links = (stage > 0) + (stage < len(stage_ranges) - 1)
    in_width, out_width = dims[layers.start], dims[layers.stop]
    per_slot = rows * (in_width + out_width) * itemsize + SLOT_BYTES + SLOT_LINK_BYTES * links + \
        SLOT_LAYER_BYTES * len(layers) * row_counts
    widths = [dims[i + 1] for i in layers]
    n_params = sum(dims[i] * dims[i + 1] + (dims[i + 1] if model.bias else 0) for i in layers)
    inner = max(widths[:-1], default=0)
    between = (2 if len(widths) > 2 else 1 if len(widths) > 1 else 0) * inner
    scratch = rows * (between + (sum(widths) if model.bias else 0) + max(widths)) * itemsize
    return StageBytes(stage, rows, in_width, out_width, slots * per_slot, n_params * itemsize, scratch)


def check_memory(config: Config, stage_ranges: list[range], n_rows: int, world_size: int,
                 available: int | None = None, ranks_here: int | None = None,
                 headroom: int | None = None) -> StageBytes:
    """Raise ConfigError when a rank's share of the node cannot hold its stage; return the largest stage's need.

    The share is training's (:func:`hpcpipe.runtime.host_memory.rank_share`): the
    node's available memory over its ranks, or less under ``ulimit -v``.
    """
    worst = max((stage_bytes(config, stage_ranges, s, n_rows) for s in range(len(stage_ranges))),
                key=lambda b: b.total)
    share, where = rank_share(ranks_here or local_rank_count(default=world_size), available, headroom)
    if share is None or worst.total <= share:
        return worst
    inf = config.infer
    itemsize = ITEMSIZE[config.model.dtype]
    raise ConfigError(
        f"inference needs about {_size(worst.total)} ({worst.total} bytes) per rank: infer.buffers = {inf.buffers} "
        f"slot buffers of {worst.rows} row(s) (infer.micro_batch_size = {inf.micro_batch_size}) x "
        f"({worst.in_width} + {worst.out_width}) values x {itemsize} bytes, with their bookkeeping, take "
        f"{_size(worst.buffers)} on pipeline stage {worst.stage}, its parameters {_size(worst.parameters)} and "
        f"layer scratch {_size(worst.scratch)}; {where}: lower infer.buffers (2 is double buffering) or "
        f"infer.micro_batch_size, or use more pipeline stages or nodes")


def _size(n: float) -> str:
    """A byte count for people: '512 bytes', '3.1 KiB', '51.2 GiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
