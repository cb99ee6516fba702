"""serve and generate refuse a layout whose rank cannot hold its stage and KV cache, before loading anything."""

import pytest

from hpcpipe.config import load_config
from hpcpipe.errors import ConfigError
from hpcpipe.serve.setup import check_decode_memory

GIB = 1 << 30
GPT = ["model.kind=gpt", "model.vocab_size=256", "model.seq_len=1024", "model.d_model=64", "model.n_heads=4",
       "model.n_blocks=2", "parallel.pp=1", "serve.max_sequences=64"]


def _needs(cfg):
    from hpcpipe.nn.memory import decode_rank_bytes
    return sum(decode_rank_bytes(cfg, [range(4)]))


def test_the_node_share_decides_without_an_address_space_limit(monkeypatch):
    cfg = load_config(None, GPT)
    need = _needs(cfg)
    check_decode_memory(cfg, [range(4)], 1, available=need + 1)
    with pytest.raises(ConfigError, match=r"this node has .* available for 1 rank\(s\)"):
        check_decode_memory(cfg, [range(4)], 1, available=need - 1)


def test_an_address_space_limit_below_the_share_is_what_a_rank_may_use():
    # was: the node's MemAvailable alone, so under ulimit -v the job started and died of a MemoryError
    cfg = load_config(None, GPT)
    need = _needs(cfg)
    with pytest.raises(ConfigError, match=r"each rank has .* left under its address-space limit \(ulimit -v"):
        check_decode_memory(cfg, [range(4)], 1, available=64 * GIB, headroom=need - 1)
    check_decode_memory(cfg, [range(4)], 1, available=64 * GIB, headroom=need + 1)


def test_the_hint_names_values_that_fit_below_the_ones_given():
    """It suggested --set model.seq_len=4096 whatever the model's context (above it for a 1024-token model)."""
    from hpcpipe.nn.memory import decode_rank_bytes
    cfg = load_config(None, GPT)
    params, cache = decode_rank_bytes(cfg, [range(4)])
    with pytest.raises(ConfigError) as info:
        check_decode_memory(cfg, [range(4)], 1, available=params + cache // 2 + 1)
    message = str(info.value)
    assert "--set model.seq_len=512" in message and "--set serve.max_sequences=32" in message, message
    assert "4096" not in message and "\n" not in message
    for fix in ("model.seq_len=512", "serve.max_sequences=32"):      # what it names fits
        check_decode_memory(load_config(None, [*GPT, fix]), [range(4)], 1, available=params + cache // 2 + 1)
    with pytest.raises(ConfigError, match=r"the parameters alone do not fit: use more stages \(parallel.pp\)"):
        check_decode_memory(cfg, [range(4)], 1, available=params - 1)
