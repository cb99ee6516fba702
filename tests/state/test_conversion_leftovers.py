"""checkpoint import and export leave nothing behind (issue 40): a full disk or a file size limit is one line, not
20 HDF5 tracebacks and a segfault beside a hidden temporary file; SIGTERM mid-write removes the temporary; a value
that --dtype float16/bfloat16 cannot hold is refused by name, nothing written."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error, run_module
from support.state import small_tmpfs

from hpcpipe.config import from_dict
from hpcpipe.nn.registry import model_def
from hpcpipe.state.tokenizer import StoredTokenizer, Tokenizer
from hpcpipe.state.weights import write_weights

pytest.importorskip("torch")
pytest.importorskip("transformers")
PAUSE = "HPCPIPE_PAUSE_IN_WRITE"    # test hook: the writing child sleeps this long once its temporary exists


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
    directory = save_model(model, tmp_path_factory.mktemp("hf") / "llama")
    save_tokenizer(tok, directory, eos_token="<|endoftext|>")
    return directory


def _gpt_file(path: Path, big: float | None = None) -> Path:
    """A bytes-tokenized GPT weights file; ``big`` goes into one entry of block 1's attn/qkv/weight."""
    config = from_dict({"model": {"kind": "gpt", "vocab_size": 256, "seq_len": 16, "d_model": 16, "n_heads": 2,
                                  "n_blocks": 2}, "parallel": {"pp": 1}})
    model = model_def(config)
    arrays = model.init_arrays(list(range(model.n_layers)), 0, "float32")
    if big is not None:
        arrays[1]["attn/qkv/weight"][3, 5] = big
    write_weights(path, arrays, n_layers=model.n_layers, model_config=config.to_dict()["model"],
                  tokenizer=StoredTokenizer(Tokenizer("bytes").to_json()))
    return path


def _left(directory: Path, *expected: str) -> None:
    assert sorted(p.name for p in directory.iterdir()) == sorted(expected), list(directory.iterdir())


def test_import_past_the_file_size_limit_is_one_line_and_leaves_nothing(hf, tmp_path):
    """ulimit -f: the write fails half-way as on a full disk (HDF5 then crashes on close: the child's crash)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "hpcpipe.checkpoint", "import", str(hf), str(out_dir / "m.h5")],
                          capture_output=True, text=True, timeout=120, preexec_fn=limit, cwd=ROOT, check=False)
    one_error(proc, "cannot write import output", "file size limit", "nothing was left behind", code=1, alone=True)
    _left(out_dir)


def test_import_onto_a_small_file_system_is_refused_before_writing(hf, tmp_path):
    with small_tmpfs(tmp_path / "full", "64k") as full:
        proc = run_module("hpcpipe.checkpoint", "import", hf, full / "m.h5", timeout=120)
        one_error(proc, "cannot write import output", "64.0 KiB free", "nothing was written", code=1, alone=True)
        _left(full)


def test_import_when_the_disk_fills_meanwhile_leaves_nothing(hf, tmp_path):
    with small_tmpfs(tmp_path / "full", "2m") as full:
        argv = [sys.executable, "-m", "hpcpipe.checkpoint", "import", str(hf), str(full / "m.h5")]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, PAUSE: "2"})
        _wait_for_temporary(full, proc)
        with open(full / "filler", "wb") as f:     # the space the check before writing saw is gone
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        out, err = proc.communicate(timeout=120)
        (full / "filler").unlink()
        one_error(subprocess.CompletedProcess(argv, proc.returncode, out, err), "cannot write import output",
                  "full", "nothing was left behind", code=1, alone=True)
        _left(full)


def _wait_for_temporary(directory: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not any(p.name.startswith(".") for p in directory.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("command", ["import", "export", "export-hf"])
def test_sigterm_while_writing_leaves_no_temporary(hf, tmp_path, command):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = {"import": ["import", str(hf), str(out_dir / "m.h5")],
            "export": ["export", str(_gpt_file(tmp_path / "gpt.h5")), str(out_dir / "m.h5")],
            "export-hf": ["export", str(_gpt_file(tmp_path / "gpt.h5")), str(out_dir / "m"), "--format", "hf"]}
    argv = [sys.executable, "-m", "hpcpipe.checkpoint", *args[command]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, PAUSE: "60"})
    _wait_for_temporary(out_dir, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75 and "Traceback" not in err, (proc.returncode, err)
    assert err.strip().startswith("hpcpipe: stopped (SIGTERM)") and "nothing was written" in err, err
    assert len(err.strip().splitlines()) == 1, err
    _left(out_dir)


@pytest.mark.parametrize("dtype,value", [("float16", 70000.0), ("float16", -65520.0), ("bfloat16", 3.4e38)])
def test_export_refuses_a_value_its_dtype_cannot_hold(tmp_path, dtype, value):
    weights = _gpt_file(tmp_path / "gpt.h5", big=value)
    out = tmp_path / "hf"
    proc = run_module("hpcpipe.checkpoint", "export", weights, out, "--format", "hf", "--dtype", dtype, timeout=120)
    one_error(proc, "transformer.h.0.attn.c_attn.weight", f"holds {value:.6g}", f"beyond {dtype}'s largest value",
              "nothing was written", alone=True)
    _left(tmp_path, "gpt.h5")
    ok = run_module("hpcpipe.checkpoint", "export", _gpt_file(tmp_path / "fine.h5", big=60000.0), out,
                    "--format", "hf", "--dtype", "float16", timeout=120)
    assert ok.returncode == 0, ok.stderr
    shutil.rmtree(out)
