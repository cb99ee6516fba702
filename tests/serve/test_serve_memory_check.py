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
