"""generate and serve choose pp themselves whenever parallel.pp is not given (a new-user trial: any other parallel
key, even a no-op parallel.ep=1, brought back training's default pp = 4 and "world size 2 is not divisible")."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error
from support.serve import Server, generate

from hpcpipe.config import from_dict, resolve_layout
from hpcpipe.errors import ConfigError
from hpcpipe.serve.setup import decode_layout

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_heads": 2, "n_blocks": 4}   # 6 groups


@pytest.mark.parametrize("world,par,layout", [
    (2, {}, (1, 2)),
    (2, {"ep": 1}, (1, 2)),
    (2, {"tp": 2}, (1, 1)),
    (2, {"dp": 2}, (2, 1)),
    (8, {"dp": 2}, (2, 4)),
    (8, {"tp": 2}, (1, 4)),
    (12, {}, (2, 6)),               # 6 layer groups: at most 6 stages, dp the rest
    (2, {"pp": 1}, (2, 1)),         # a given pp wins
])
def test_pp_is_chosen_when_not_given(world, par, layout):
    config = from_dict(decode_layout({"model": GPT, "parallel": par}, world))
    assert resolve_layout(config, world) == layout


def test_ep_is_respected():
    moe = {**GPT, "kind": "moe", "n_experts": 4, "experts_per_token": 2, "d_ff": 32}
    for world, par, layout in ((2, {"ep": 2}, (2, 1)), (8, {"ep": 2}, (2, 4)), (8, {"ep": 4}, (4, 2))):
        config = from_dict(decode_layout({"model": moe, "parallel": par}, world))
        assert resolve_layout(config, world) == layout


def test_virtual_stages_is_refused_for_what_it_is():
    with pytest.raises(ConfigError, match=r"virtual_stages must be 1, got 2"):
        decode_layout({"model": GPT, "parallel": {"virtual_stages": 2}}, 1)
    with pytest.raises(ConfigError, match=r"virtual_stages must be 1, got 2"):
        decode_layout({"model": GPT, "parallel": {"pp": 1, "virtual_stages": 2}}, 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama and a tiny mixtral (4 experts) as Hugging Face directories with a 300-token tokenizer."""
    folder = tmp_path_factory.mktemp("hf")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    out = {}
    for arch in ("llama", "mixtral"):
        model = tiny_model(arch, vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
        out[arch] = save_tokenizer(tok, save_model(model, folder / arch), eos_token="<|endoftext|>")
    return out


GREEDY = ("--max-new-tokens", "8", "--temperature", "0")


@pytest.mark.parametrize("arch,sets", [
    ("mixtral", ["parallel.ep=2"]),
    ("mixtral", ["parallel.dp=2"]),
    ("mixtral", ["parallel.ep=1"]),
    ("llama", ["parallel.tp=2"]),
    ("llama", ["parallel.dp=2", "parallel.tp=1"]),
])
def test_generate_on_two_ranks_with_a_parallel_key_but_no_pp(models, tmp_path, arch, sets):
    proc, one = generate(tmp_path, 1, models[arch], "MPI is", *GREEDY)
    assert proc.returncode == 0, proc.stderr
    args = [word for s in sets for word in ("--set", s)]
    proc, two = generate(tmp_path, 2, models[arch], "MPI is", *GREEDY, *args, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert two["tokens"] == one["tokens"]           # greedy: the same tokens at any layout


def test_a_config_file_parallel_table_without_pp(models, tmp_path):
    config = tmp_path / "gen.toml"
    config.write_text("[parallel]\nep = 2\n")
    proc, out = generate(tmp_path, 2, models["mixtral"], "MPI is", *GREEDY, "--config", str(config), timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert out["finish_reason"] == "length" and len(out["tokens"]) == 8


def test_virtual_stages_on_one_rank_is_one_line_exit_2(models, tmp_path):
    proc, _ = generate(tmp_path, 1, models["llama"], "x", "--set", "parallel.virtual_stages=2")
    one_error(proc, "virtual_stages must be 1, got 2")


def test_serve_on_two_ranks_with_ep_but_no_pp(models):
    with Server(2, models["mixtral"], "--set", "parallel.ep=2") as s:
        reply = s.client().completions.create(model="mixtral", prompt="MPI is", max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length"
