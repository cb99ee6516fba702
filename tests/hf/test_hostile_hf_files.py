"""A Hugging Face directory written by a careless or hostile author (issue 40): every file hpcpipe parses nested
100,000 levels deep, sizes no model has, is one line and exit 2 at once, never a traceback or minutes of start-up."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
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


# ---- files outside the model directory, files that are no files ----------------------------------------------

def test_a_link_out_of_the_model_directory_is_refused_and_nothing_is_read(hf, tmp_path):
    """chat_template.jinja -> /etc/passwd was followed and its text embedded in the imported weights file."""
    (hf / "chat_template.jinja").symlink_to("/etc/passwd")
    out = tmp_path / "out.h5"
    proc = run_module("hpcpipe.checkpoint", "import", hf, out, timeout=120)
    one_error(proc, "chat_template.jinja", "symbolic link to '/etc/passwd'", "outside the model directory")
    assert not out.exists()
    proc = run_command(1, "hpcpipe.generate", ["--weights", str(hf), "--prompt", "hi", "--max-new-tokens", "2"],
                       timeout=120)
    one_error(proc, "chat_template.jinja", "outside the model directory")


def test_links_inside_the_directory_and_the_hub_cache_layout_are_followed(hf, tmp_path):
    """A snapshot of the hub cache links every file to ../../blobs/: that is the model's own folder."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(hf.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(f"../../blobs/blob{i}")
    (hf / "generation_config.json").rename(hf / "generation.json")
    (hf / "generation_config.json").symlink_to("generation.json")      # a link inside the directory
    for model in (snapshot, hf):
        out = tmp_path / f"{model.name}.h5"
        proc = run_module("hpcpipe.checkpoint", "import", model, out, timeout=120)
        assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("how,words", [
    ("dev-zero", ["model.safetensors", "symbolic link to '/dev/zero'", "outside the model directory"]),
    ("fifo", ["model.safetensors", "is a named pipe, not a regular file"]),
    ("directory", ["model.safetensors", "is a directory, not a regular file"]),
    ("config-link", ["config.json", "outside the model directory"]),
])
def test_weights_and_config_that_are_no_regular_files_are_named(hf, tmp_path, how, words):
    """model.safetensors -> /dev/zero was reported as missing ('holds neither model.safetensors nor ...')."""
    import os
    if how == "config-link":
        outside = tmp_path / "elsewhere.json"
        (hf / "config.json").rename(outside)
        (hf / "config.json").symlink_to(outside)
    else:
        (hf / "model.safetensors").unlink()
        {"dev-zero": lambda p: p.symlink_to("/dev/zero"), "fifo": os.mkfifo, "directory": Path.mkdir}[how](
            hf / "model.safetensors")
    proc = run_module("hpcpipe.checkpoint", "import", hf, tmp_path / "out.h5", timeout=120)
    one_error(proc, *words)


def test_a_safetensors_header_over_16_mib_is_refused_before_it_is_parsed(hf, tmp_path):
    """An 82 MB header cost 1.3 GB on every rank to parse."""
    raw = (hf / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {"format": "pt", "padding": "x" * (17 << 20)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (hf / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    proc = run_module("hpcpipe.checkpoint", "import", hf, tmp_path / "out.h5", timeout=120)
    one_error(proc, "model.safetensors", f"header is {len(text)} bytes", "limit of 16777216")


def test_tensors_the_model_does_not_use_are_named_in_a_warning(hf, tmp_path):
    """Extra tensors were ignored silently; transformers' own ignored buffers stay unmentioned."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.layers.0.mlp.extra_proj.weight"] = np.ones((4, 4), np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    proc = run_module("hpcpipe.checkpoint", "import", hf, tmp_path / "out.h5", timeout=120)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("hpcpipe: warning:")]
    assert len(warnings) == 1 and "1 tensor(s)" in warnings[0], proc.stderr
    assert "'model.layers.0.mlp.extra_proj.weight'" in warnings[0] and "inv_freq" not in warnings[0]


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_import(hf, tmp_path):
    """Import accepted it and generate refused the import ('its tokenizer has 302 tokens'), unexplained."""
    path = hf / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "extra_special_tokens": ["<tool>", "<call>"]}))
    out = tmp_path / "out.h5"
    proc = run_module("hpcpipe.checkpoint", "import", hf, out, timeout=120)
    one_error(proc, "tokenizer has 302 token ids", "model.vocab_size = 300", "300 '<tool>'", "301 '<call>'",
              "special tokens")
    assert not out.exists()
