"""Helpers of the generation and serving tests: small GPT weights with a tokenizer, the real commands under mpiexec."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.state.weights import write_weights
from support import ROOT, launchers
from support.launch import command, run

CHARS = " abcdefghijklmnopqrstuvwxyz.,!?'"


def make_weights(path: str | Path, *, tied: bool = True, dtype: str = "float64", seed: int = 3, seq_len: int = 32,
                 d_model: int = 16, n_blocks: int = 4, n_heads: int = 2, tokenizer: dict | None = None,
                 vocab: int | None = None) -> Decoder:
    """Write a small GPT (weights drawn larger than at init, so its choices are far from uniform); return it.

    ``vocab`` (default: the tokenizer's) may exceed the tokenizer's: a model with ids no text maps to.
    """
    tokenizer = tokenizer or {"kind": "chars", "chars": CHARS}
    vocab = vocab or (256 if tokenizer["kind"] == "bytes" else len(tokenizer["chars"]))
    shape = GPTShape(vocab=vocab, seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_blocks=n_blocks, tied=tied)
    model = Decoder(GPTModel(shape), np, dtype, seed=seed)
    model.flat[...] += 0.3 * np.random.default_rng(seed).standard_normal(model.flat.shape).astype(dtype)
    groups = {i: {name: np.array(view) for name, view in model.params[i].items()} for i in range(shape.n_groups)}
    config = {"kind": "gpt", "vocab_size": vocab, "seq_len": seq_len, "d_model": d_model, "n_heads": n_heads,
              "n_blocks": n_blocks, "d_ff": 0, "tie_embeddings": tied, "dtype": dtype}
    write_weights(path, groups, n_layers=shape.n_groups, model_config=config,
                  attrs={"tokenizer": json.dumps(tokenizer)})
    return model


def encode(text: str) -> list[int]:
    """Token ids of text under the chars tokenizer of make_weights."""
    return [CHARS.index(c) for c in text]


def generate(tmp: Path, n: int, weights: Path, prompt: str, *args: str, timeout: float = 120,
             env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run `mpiexec -n N python -m hpcpipe.generate`; return (process, its --json result or None)."""
    out = tmp / f"gen-{time.monotonic_ns()}.json"
    argv = command(n, "hpcpipe.generate", ["--weights", str(weights), "--prompt", prompt, "--json", str(out),
                                           *args])
    proc = run(argv, timeout=timeout, env=env)
    return proc, json.loads(out.read_text()) if out.exists() else None


class Server:
    """`mpiexec -n N python -m hpcpipe.serve --port 0 ...` started, waited for, and stopped."""

    def __init__(self, n: int, weights: Path, *args: str, env: dict | None = None, log: Path | None = None):
        self.log = log or Path(weights).with_suffix(f".serve-{time.monotonic_ns()}.log")
        self._out = open(self.log, "w")
        argv = command(n, "hpcpipe.serve", ["--weights", str(weights), "--port", "0", *args])
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=dict(os.environ, **(env or {})), start_new_session=True)
        self.url = self._wait_url(120)

    def _wait_url(self, seconds: float) -> str:
        deadline = time.time() + seconds
        while time.time() < deadline:
            found = re.search(r"on (http://[\d.]+:\d+)/v1", self.log.read_text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"serve did not start within {seconds} s:\n{self.log.read_text()}")

    def client(self, **kw):
        """The official OpenAI client pointed at this server."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send sig to the launcher (it forwards to every rank)."""
        self.proc.send_signal(sig)

    def wait(self, seconds: float = 60) -> int:
        """Wait for the job to end; return its exit status."""
        try:
            return self.proc.wait(seconds)
        finally:
            if self.proc.poll() is None:
                self.kill()

    def stopped_cleanly(self, seconds: float = 30) -> bool:
        """Wait for the job after a SIGTERM; True when every rank drained and exited 0.

        Open MPI's mpirun reports 1 when it was signalled although every rank exited 0
        (tests/runtime/test_guard_runs.py sees the same): there the stop line is the contract.
        """
        code = self.wait(seconds)
        stopped = "hpcpipe: stopped (SIG" in self.output()
        return stopped and (code == 0 or (code == 1 and launchers.chosen() == "openmpi"))

    def kill(self) -> None:
        """Kill the whole job (launcher and ranks)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def output(self) -> str:
        """Everything the job printed so far."""
        self._out.flush()
        return self.log.read_text()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._out.close()
