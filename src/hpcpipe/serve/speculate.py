"""Speculative decoding's proposers: prompt lookup (n-gram) and a draft model beside the target, on a replica's head.

Roughly, per decode step of a speculating sequence (the scheduler, hpcpipe.serve.scheduler, and the last
stage, hpcpipe.serve.last_stage)::

    d1..dk = proposer(tokens)                          # k <= serve.speculate_tokens, fewer near the end
    forward [last, d1..dk] at positions s..s+k          # one pass through every stage: k + 1 rows of logits
    t0 = sample(row 0); accept while t_j == d_(j+1): t_(j+1) = sample(row j + 1)
    keep t0..tj; the keys and values at positions past s + j are rolled back (the sequence's length;
    they are overwritten later and never read before)

Each t_j is drawn exactly as plain decoding draws it (the sequence's own sampler, one uniform per token, from
the logits of the same prefix), so greedy and seeded outputs are the same tokens with and without
speculation. Proposals are deterministic (a draft model proposes its argmax), so vLLM's rejection sampling,
accept d with probability min(1, p(d) / q(d)) with q one-hot, accepts d with probability p(d): exactly the
chance that the target's own draw is d, which is what accepting "t_j == d_(j+1)" does.

``NgramProposer`` finds the latest earlier occurrence of the sequence's last n tokens (n = 3, 2, 1) with k
tokens after it (else the earliest) and proposes what followed it (prompt lookup: code edits, quotes,
summaries repeat their input).
``DraftProposer`` runs a smaller model with the same tokenizer (serve.draft) over the replica's head's own
KV cache pages (the same block tables as the target, its own arrays): it catches up on the tokens it has
not seen, then proposes k tokens greedily, one batched forward per token for every speculating sequence.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.nn.core.decode_plan import Segment

NGRAM_MAX = 3       # longest suffix looked up
NGRAM_MIN = 1


def ngram_proposal(tokens: list[int], k: int, longest: int = NGRAM_MAX, shortest: int = NGRAM_MIN) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the last n tokens (longest n first).

    The latest occurrence with k tokens after it is taken, else the earliest (the most tokens after it): in a
    run that repeats itself ("////", a loop of lines) the latest occurrence ends right before the suffix and
    would propose a single token.
    """
    n_tokens = len(tokens)
    if k < 1 or n_tokens < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(longest, n_tokens - 1), shortest - 1, -1):
        suffix = arr[n_tokens - n:]
        # windows ending before the suffix itself: start i holds arr[i:i + n], followed by arr[i + n]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tokens - 1], n)
        found = np.flatnonzero((windows == suffix).all(axis=1))
        if found.size:
            full = found[found + n + k <= n_tokens]
            start = int(full[-1] if full.size else found[0]) + n
            return [int(t) for t in arr[start:start + k]]
    return []


class NgramProposer:
    """Prompt lookup: proposals from the sequence's own tokens (no model, no cache)."""

    def tables(self, updates: list, clear: list[int]) -> None:
        """Nothing to keep: the n-gram lookup reads no cache."""

    def propose(self, wanted: list[tuple[Any, int]]) -> list[list[int]]:
        """For each (sequence, k): up to k proposed tokens."""
        return [ngram_proposal(seq.tokens, k) for seq, k in wanted]

    def rolled_back(self, seq: Any, kept: int) -> None:
        """Nothing to roll back."""


class DraftProposer:
    """A draft model's greedy proposals, over the replica's block tables (see the module docstring)."""

    def __init__(self, stage: Any, vocab: int):
        self.stage, self.vocab = stage, vocab      # vocab: the ids the tokenizer can decode (argmax over those)
        self.seen: dict[int, int] = {}              # slot -> positions the draft's cache holds for its sequence

    def tables(self, updates: list, clear: list[int]) -> None:
        """Apply the target's block-table updates to the draft's cache (the same KV block ids, its own arrays)."""
        for slot, first, blocks in updates:
            self.stage.set_pages(slot, first, blocks)
            if first == 0:
                self.seen[slot] = 0                  # a new sequence in this slot: nothing of it is cached
        if clear:
            self.stage.clear_pages(clear)

    def propose(self, wanted: list[tuple[Any, int]]) -> list[list[int]]:
        """For each (sequence, k): k greedy draft tokens (fewer past the draft's context)."""
        if not wanted:
            return []
        limit = self.stage.shape.seq_len
        ks = [max(0, min(k, limit - len(seq.tokens))) for seq, k in wanted]
        live = [i for i, k in enumerate(ks) if k > 0]
        out: list[list[int]] = [[] for _ in wanted]
        if not live:
            return out
        # catch up: every token the draft has not cached yet (a whole prompt the first time), one segment each
        segments, ids = [], []
        for i in live:
            seq = wanted[i][0]
            seen = min(self.seen.get(seq.slot, 0), len(seq.tokens) - 1)
            segments.append(Segment(seq.slot, seen, len(seq.tokens) - seen))
            ids.extend(seq.tokens[seen:])
        logits = self.stage.forward(np.asarray(ids, dtype=np.int64), segments)
        for step in range(max(ks[i] for i in live)):
            picks = np.asarray(logits)[:, :self.vocab].argmax(axis=1)
            for j, i in enumerate(live):
                if len(out[i]) < ks[i]:
                    out[i].append(int(picks[j]))
            going = [j for j, i in enumerate(live) if len(out[i]) < ks[i]]
            for i in live:
                seq = wanted[i][0]
                self.seen[seq.slot] = len(seq.tokens) + step      # its proposals so far, but the last, are cached
            if not going:
                break
            live = [live[j] for j in going]
            segments = [Segment(wanted[i][0].slot, len(wanted[i][0].tokens) + step, 1) for i in live]
            logits = self.stage.forward(np.asarray([out[i][-1] for i in live], dtype=np.int64), segments)
        return out

    def rolled_back(self, seq: Any, kept: int) -> None:
        """The target kept positions [0, kept) of ``seq``: draft keys past that are of rejected tokens."""
        if self.seen.get(seq.slot, 0) > kept:
            self.seen[seq.slot] = kept
