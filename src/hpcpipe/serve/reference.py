"""The sequential no-cache generation reference: every new token recomputes the whole prefix with the training forward.

The pipelined, KV-cached engine is tested against it token for token, so it
shares nothing with ``hpcpipe.nn.core.decode`` (only the model and the sampler).
"""

from __future__ import annotations

import numpy as np

from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.serve.sampling import Sampler, SamplingParams


def reference_generate(model: Decoder, prompt: list[int], max_new: int, params: SamplingParams) -> list[int]:
    """Return up to ``max_new`` tokens after ``prompt``, stopping when prompt + generated reaches seq_len."""
    shape = model.shape
    if not prompt or len(prompt) > shape.seq_len:
        raise ValueError(f"reference_generate: the prompt must have 1..{shape.seq_len} tokens, got {len(prompt)}")
    bad = [t for t in prompt if not 0 <= t < shape.vocab]
    if bad:
        raise ValueError(f"reference_generate: prompt token {bad[0]} out of range 0..{shape.vocab - 1}")
    if max_new < 0:
        raise ValueError(f"reference_generate: max_new must be >= 0, got {max_new}")
    sampler = Sampler(params)
    tokens = [int(t) for t in prompt]
    new: list[int] = []
    while len(new) < max_new and len(tokens) < shape.seq_len:
        logits, _ = model.forward(model.xp.asarray(np.array([tokens], dtype=np.int64)))
        token = sampler.next_token(logits[0, -1])
        tokens.append(token)
        new.append(token)
    return new
