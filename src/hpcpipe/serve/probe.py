"""A probe forward at load: weights whose finite values overflow in the forward are refused before serving.

Finite weights can still make the forward overflow (a float32 embedding of 3e38 squares to inf in the
first norm): every logit is then NaN, and the job used to serve until its first request and die there.
Before the stages report ready, each replica runs one short probe prompt through its pipeline: stage 0
embeds ``probe_ids`` (token ids spread over the vocabulary) in KV-cache slot 0 and every stage checks that
its output is finite and hands it on. A stage that finds a problem hands the problem on instead, so every
stage of the replica ends the probe and the job agrees on the first problem found (exit 2, one line). The
slot is cleared afterwards. With tensor parallelism every tp rank of a stage runs the probe with the same
tokens, each along its own pp link (its stage's collectives inside ``forward``), as it decodes when
serving. Overflow that only some tokens cause (one bad row of a table) is not always seen here: such a
request fails alone while serving (hpcpipe.serve.roles, FAILED).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hpcpipe.nn.core.decode import Segment
from hpcpipe.serve.protocol import PipeTag, Probe, receive, send

PROBE_TOKENS = 16


def probe_ids(vocab: int, seq_len: int) -> list[int]:
    """Token ids of the probe prompt: up to PROBE_TOKENS ids spread evenly over [0, vocab), at most seq_len."""
    n = max(1, min(PROBE_TOKENS, seq_len, vocab))
    return [int(i) for i in np.linspace(0, vocab - 1, n).round()]


def _wait(link: Any, source: int, poll_s: float) -> tuple[Probe, Any, int]:
    while (got := receive(link, source, PipeTag.PROBE)) is None:
        time.sleep(poll_s)
    return got


def check_forward(stage: Any, link: Any, pp_rank: int, pp: int, xp: Any, to_host: Any, vocab: int,
                  poll_s: float) -> str | None:
    """Run the probe prompt through this replica (point to point over its pp ranks); return this stage's finding.

    None when the stage's output is finite (and every stage before it found nothing), else one line
    saying which stage first gave non-finite values.
    """
    # the pool holds one whole context, or under a sliding window at least one window's blocks; a windowed
    # block's ring (beside full blocks) holds the positions one call may write
    rings = stage.rings.pages // stage.slots if stage.rings is not None else stage.paged.pages
    ids = probe_ids(vocab, min(stage.shape.seq_len, stage.paged.pages * stage.paged.page, rings * stage.paged.page))
    pages = list(range(-(-len(ids) // stage.paged.page)))
    problem, out = None, None
    if pp_rank == 0:
        x = xp.asarray(np.asarray(ids, dtype=np.int64))
    else:
        message, x, _ = _wait(link, pp_rank - 1, poll_s)
        problem = message.problem
    if problem is None:
        try:
            with np.errstate(all="ignore"):       # the overflow is reported below, once, as one line
                stage.set_pages(0, 0, pages)
                out = stage.forward(x, [Segment(0, 0, len(ids))])
                bad = int(np.size(host := np.asarray(to_host(out)))) - int(np.isfinite(host).sum())
            if bad:
                groups = stage.groups
                problem = (f"the model's forward is not finite: stage {pp_rank} (layer groups {groups.start}.."
                           f"{groups.stop - 1}) turns a probe prompt of {len(ids)} tokens into {bad} of "
                           f"{host.size} values that are inf or NaN in {stage.dtype}; finite weights too large "
                           f"for {stage.dtype} overflow (e.g. |w| near 3e38): check or rescale the weights")
        except Exception as exc:  # noqa: BLE001 - reported as this stage's finding, agreed on by every rank
            problem = f"the probe forward failed on stage {pp_rank}: {type(exc).__name__}: {exc}"
    stage.clear_pages(pages)
    if pp_rank < pp - 1:
        send(link, pp_rank + 1, Probe(problem), out if problem is None else None)
    link.flush()
    return problem
