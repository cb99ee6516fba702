"""A Hugging Face directory written by a careless or hostile author (issue 40): every file hpcpipe parses nested
100,000 levels deep, sizes no model has, is one line and exit 2 at once, never a traceback or minutes of start-up."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error, run_command, run_module

from hpcpipe.errors import ConfigError
from hpcpipe.hf.config import read_hf_config

pytest.importorskip("torch")
pytest.importorskip("transformers")

DEEP = "[" * 100_000
MAX_DEPTH = 128      # hpcpipe.hf.json_text.MAX_DEPTH (imported in the tests: absent before issue 40)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One tiny llama directory (config.json, generation_config.json, safetensors, tokenizer files)."""
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
    directory = save_model(model, tmp_path_factory.mktemp("hf") / "llama")
    save_tokenizer(tok, directory, eos_token="<|endoftext|>")
    return directory


@pytest.fixture
def hf(made, tmp_path) -> Path:
    """A fresh copy of the tiny llama directory, to damage."""
    return Path(shutil.copytree(made, tmp_path / "llama"))


def _depth(o) -> int:
    if isinstance(o, dict):
        return 1 + max((_depth(v) for v in o.values()), default=0)
    if isinstance(o, list):
        return 1 + max((_depth(v) for v in o), default=0)
    return 0


def test_nesting_depth_counts_brackets_outside_strings_only():
    from hpcpipe.hf.json_text import loads, nesting_depth
    rng = random.Random(0)
    pieces = ['[', ']', '{', '}', '"', '\\', 'a', 'é', '\n', '\\"', '\\\\', '😀']

    def text() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))

    def doc(depth: int):
        r = rng.random()
        if depth > 6 or r < 0.3:
            return rng.choice([1, None, 2.5, text()])
        if r < 0.65:
            return [doc(depth + 1) for _ in range(rng.randint(0, 3))]
        return {text(): doc(depth + 1) for _ in range(rng.randint(0, 3))}

    for _ in range(2000):
        o = doc(0)
        for ascii_only in (True, False):
            t = json.dumps(o, ensure_ascii=ascii_only)
            assert nesting_depth(t) == nesting_depth(t.encode()) == _depth(o), t
            assert loads(t) == o


@pytest.mark.parametrize("text,words", [
    (DEEP, ["100000 levels deep", f"limit of {MAX_DEPTH}"]),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), [f"{MAX_DEPTH + 1} levels deep"]),
    ("1" * 5000, ["4300 digits"]),
    (b"\xff{}", ["not UTF-8"]),
    ("{", ["not valid JSON", "line 1 column 2"]),
])
def test_bounded_loads_refuses_in_one_line(text, words):
    from hpcpipe.hf.json_text import MAX_DEPTH as LIMIT
    from hpcpipe.hf.json_text import JSONTextError, loads
    assert LIMIT == MAX_DEPTH
    with pytest.raises(JSONTextError) as info:
        loads(text)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None


def _nest(directory: Path, which: str) -> None:
    """Replace one JSON text of the directory by 100,000 opening brackets."""
    if which == "index":
        (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
        (directory / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP)
    elif which == "header":
        raw = (directory / "model.safetensors").read_bytes()
        n = int.from_bytes(raw[:8], "little")
        (directory / "model.safetensors").write_bytes(len(DEEP).to_bytes(8, "little") + DEEP.encode() + raw[8 + n:])
    else:
        (directory / which).write_text(DEEP)


FILES = ["config.json", "generation_config.json", "tokenizer_config.json", "index", "header", "tokenizer.json"]


@pytest.mark.parametrize("which", FILES)
def test_deeply_nested_json_in_any_file_is_one_line_exit_2_on_import(hf, tmp_path, which):
    _nest(hf, which)
    out = tmp_path / "out.h5"
    proc = run_module("hpcpipe.checkpoint", "import", hf, out, timeout=120)
    one_error(proc, "levels deep", f"limit of {MAX_DEPTH}")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["llama"]


@pytest.mark.parametrize("which", ["config.json", "header"])
def test_deeply_nested_json_is_one_line_exit_2_on_generate(hf, which):
    _nest(hf, which)
    proc = run_command(1, "hpcpipe.generate", ["--weights", str(hf), "--prompt", "hi", "--max-new-tokens", "2",
                                               "--set", "parallel.pp=1"], timeout=120)
    one_error(proc, "100000 levels deep")


def _config(directory: Path, **keys) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))


@pytest.mark.parametrize("key,value,limit", [("num_hidden_layers", 100_000, "4096"),
                                             ("num_hidden_layers", 10 ** 8, "4096"),
                                             ("vocab_size", 10 ** 12, str(1 << 24)),
                                             ("hidden_size", 1e300, str(1 << 17))])
def test_model_sizes_above_the_limits_are_refused_before_anything_is_built(hf, key, value, limit):
    """num_hidden_layers = 100,000 spent 13 minutes cutting stages (deaf to SIGTERM); 10**8 took 3.7 GB."""
    _config(hf, **{key: value})
    with pytest.raises(ConfigError) as info:
        read_hf_config(hf)
    assert f"{key} = {value!r}" in str(info.value) and limit in str(info.value)
    proc = run_command(1, "hpcpipe.generate", ["--weights", str(hf), "--prompt", "hi", "--max-new-tokens", "2",
                                               "--set", "parallel.pp=1"], timeout=120)
    one_error(proc, f"{key} = {value!r}", f"limit of {limit}", "config.json")


def test_start_up_at_the_layer_limit_is_quick(hf):
    """4096 layers (the limit) and 2 in the file: the missing tensors are named after a start-up linear in layers."""
    _config(hf, num_hidden_layers=4096)
    proc = run_command(2, "hpcpipe.generate", ["--weights", str(hf), "--prompt", "hi", "--max-new-tokens", "2",
                                               "--set", "parallel.pp=2"], timeout=120)
    one_error(proc, "holds no tensor", "model.layers.2.")
