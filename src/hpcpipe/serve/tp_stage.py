"""A serving stage split over tensor-parallel ranks: tp rank 0 drives, the other tp ranks follow its calls.

The roles (``Head``, ``Follower``) and the links between stages run on each stage's tp rank 0 only, so the
front end, the broker, the scheduler and the pipeline messages are those of tp = 1. Every ``forward`` of
tp rank 0's stage (``TPDriver``) first hands the call to the stage's other tp ranks (``TPWorker``): the
rows and the stage's input (token ids, or the activation the previous stage's tp rank 0 sent; the next
stage's tp rank 0 thus hands it on, the "root sends, the stage broadcasts" way of the tensor-parallel
contract). Then every tp rank runs its part of the stage (hpcpipe.nn.core.decode with the TPGroup: the rank's
heads and KV cache, MLP columns and vocabulary rows, two allreduces per block), and on the head stage
tp rank 0 gathers the vocabulary-parallel logits to sample from.

Messages on the tp communicator (hpcpipe.serve.protocol, TPTag.CALL)::

    tp rank 0 -> tp rank r      Forward(rows, logit_rows) + x   SetPages(slot, first, pages)   ClearPages(pages)
                                StopTP()

``logit_rows`` (echo with logprobs: hpcpipe.serve.last_stage) names the rows the head stage applies its
vocabulary-parallel head to instead of each segment's last; every tp rank of the stage applies it to the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.sharding import vocab_range
from hpcpipe.serve.last_stage import forward_rows
from hpcpipe.serve.protocol import ClearPages, Forward, SetPages, StopTP, TPTag, from_rows, receive, send, to_rows


def _widths(stage: DecodeStage, size: int) -> list[int]:
    """Logit columns each tp rank holds (its vocabulary part)."""
    vocab = stage.shape.vocab
    return [vocab_range(vocab, size, r)[1] - vocab_range(vocab, size, r)[0] for r in range(size)]


class TPDriver:
    """Tp rank 0's view of its stage: forward hands the call to the other tp ranks, then runs its own part."""

    def __init__(self, stage: DecodeStage, box: Any, group: Any, xp: Any):
        self.stage, self.box, self.group, self.xp = stage, box, group, xp
        self.widths = _widths(stage, group.size)

    @property
    def cache_bytes(self) -> int:
        """Bytes of this rank's part of the KV cache."""
        return self.stage.cache_bytes

    def forward(self, x: Any, segments: list[Segment]) -> Any:
        """Run the whole stage over the segments; the head stage returns every token id's logits (gathered)."""
        return self.forward_rows(x, segments, None)

    def forward_rows(self, x: Any, segments: list[Segment], rows: list[int] | None) -> Any:
        """As forward; the head stage returns the logits of ``rows`` of the call (None: each segment's last)."""
        call = Forward(to_rows(segments), rows)
        x = x if isinstance(x, np.ndarray) else self.xp.ascontiguousarray(x)
        for peer in range(1, self.group.size):
            send(self.box, peer, call, x)
        out = forward_rows(self.stage, x, segments, rows)
        if self.stage.has_head:
            out = self.xp.asarray(self.group.gather_columns(out, self.widths))
        return out

    def set_pages(self, slot: int, first: int, pages: list[int]) -> None:
        """Give a slot these KV blocks on every tp rank of the stage (before the forward that uses them)."""
        for peer in range(1, self.group.size):
            send(self.box, peer, SetPages(slot, first, pages))
        self.stage.set_pages(slot, first, pages)

    def clear_pages(self, pages: list[int]) -> None:
        """Zero KV blocks on every tp rank of the stage (a failed request's, before their next user)."""
        for peer in range(1, self.group.size):
            send(self.box, peer, ClearPages(pages))
        self.stage.clear_pages(pages)

    def stop(self) -> None:
        """Tell the other tp ranks to leave their loops; complete every send."""
        for peer in range(1, self.group.size):
            send(self.box, peer, StopTP())
        self.box.flush()


class TPWorker:
    """A tp rank > 0 of a stage: runs each call its tp rank 0 hands over, in order, until told to stop."""

    def __init__(self, stage: DecodeStage, box: Any, group: Any):
        self.stage, self.box, self.group = stage, box, group
        self.widths = _widths(stage, group.size)
        self.done = False
        self.items = 0
        self.fault_at = -1       # test hook (HPCPIPE_FAULT): raise before this work item

    def step(self) -> bool:
        """Run the next handed-over call, if one has arrived; return True if one came."""
        got = receive(self.box, 0, TPTag.CALL)
        if got is None:
            return False
        message, x, _ = got
        if isinstance(message, StopTP):
            self.done = True
            return True
        if isinstance(message, ClearPages):
            self.stage.clear_pages(message.pages)
            return True
        if isinstance(message, SetPages):
            self.stage.set_pages(message.slot, message.first, message.pages)
            return True
        if self.items == self.fault_at:
            raise RuntimeError(f"injected fault (HPCPIPE_FAULT) before work item {self.items}")
        self.items += 1
        out = forward_rows(self.stage, x, from_rows(message.rows), message.logit_rows)
        if self.stage.has_head:
            self.group.gather_columns(out, self.widths)
        return True
