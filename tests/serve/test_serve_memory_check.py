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


def test_the_hint_names_no_shorter_context_for_weights_that_fix_it(tmp_path):
    from support.serve import make_weights

    from hpcpipe.nn.memory import decode_rank_bytes
    from hpcpipe.runtime.host_memory import rank_share
    from hpcpipe.serve.setup import prepare
    make_weights(tmp_path / "gpt.h5", seq_len=256)
    one = prepare(tmp_path / "gpt.h5", 1, None, ["serve.max_sequences=1"])
    share = rank_share(1, None, None)[0]
    if share is None:
        pytest.skip("this node's available memory is unknown: serve checks nothing")
    # 20 times what fits: a context of 256 / 20 tokens would fit, if the weights allowed another context
    sequences = 20 * share // decode_rank_bytes(one.config, [range(one.shape.n_groups)])[1]
    with pytest.raises(ConfigError) as info:
        prepare(tmp_path / "gpt.h5", 1, None, [f"serve.max_sequences={sequences}"])
    # was: "or lower model.seq_len (... --set model.seq_len=17)", which the GPT's weights then refuse
    assert "lower serve.max_sequences (at most" in str(info.value) and "model.seq_len=" not in str(info.value)


def test_a_kv_block_longer_than_the_context_is_named_in_the_hint():
    from hpcpipe.nn.memory import decode_rank_bytes
    cfg = load_config(None, [*GPT, "serve.kv_block=100000"])      # a block 100x the 1024-token context
    params, cache = decode_rank_bytes(cfg, [range(4)])
    available = sum(decode_rank_bytes(load_config(None, GPT), [range(4)])) + 1
    with pytest.raises(ConfigError) as info:
        check_decode_memory(cfg, [range(4)], 1, available=available)
    # was: only "use more stages" or a smaller max_sequences, with every sequence holding 100000 positions
    assert "lower serve.kv_block to at most model.seq_len (--set serve.kv_block=16: a block of 100000 positions" \
        in str(info.value), str(info.value)
    check_decode_memory(load_config(None, [*GPT, "serve.kv_block=16"]), [range(4)], 1, available=available)
