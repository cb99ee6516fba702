"""What the GPU benchmark's pieces share: paths, the sizes, a time budget, subprocesses logged to one file.

Sizes: ``full`` is the issue's model (GPT d 2048, 16 blocks, T 1024, untied head, vocab 8192; trained in
micro-batches of 2 sequences, 8 per step) and a Llama of the same width for serving; ``quick`` is a toy of the
same kinds for the CPU rehearsal (bench/gpu/check.sh without CuPy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)

SIZES = {
    "full": {"gpt": {"vocab": 8192, "seq_len": 1024, "d_model": 2048, "n_heads": 16, "n_blocks": 16, "d_ff": 0},
             "micro_batches": 8, "micro_batch_size": 2,
             # serving: the GPT's shape with a 96-character vocabulary (one character = one token) and a
             # 512-token context, and a Llama of the same width (GQA 32/8 heads, SwiGLU 5632, RoPE, RMSNorm)
             "serve_gpt": {"seq_len": 512, "d_model": 2048, "n_heads": 16, "n_blocks": 16},
             "serve_llama": {"seq_len": 512, "d_model": 2048, "n_heads": 32, "n_kv_heads": 8, "n_blocks": 16,
                             "d_ff": 5632},
             "prompt_chars": 32, "max_tokens": 64, "clients": [1, 64], "warmup_s": 3.0, "window_s": 8.0,
             "steps": 3, "warmup_steps": 1, "matmul_n": 8192},
    "quick": {"gpt": {"vocab": 64, "seq_len": 32, "d_model": 64, "n_heads": 4, "n_blocks": 2, "d_ff": 0},
              "micro_batches": 4, "micro_batch_size": 2,
              "serve_gpt": {"seq_len": 64, "d_model": 64, "n_heads": 4, "n_blocks": 2},
              "serve_llama": {"seq_len": 64, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 2, "d_ff": 128},
              "prompt_chars": 16, "max_tokens": 8, "clients": [1, 4], "warmup_s": 1.0, "window_s": 2.0,
              "steps": 2, "warmup_steps": 1, "matmul_n": 256},
}


MPIEXEC_ENV = "HPCPIPE_GPU_MPIEXEC"     # check.sh sets it to the mpiexec of the MPI that mpi4py loads


def mpiexec() -> str:
    """The mpiexec to start ranks with: $HPCPIPE_GPU_MPIEXEC (check.sh: the carried MPICH's), else the one beside
    this Python (the venv's mpich wheel, the MPI its mpi4py loads), else the first on PATH.

    The first on PATH may belong to another MPI than the one this Python's mpi4py loads (a site's module beside a
    venv with the mpich wheel): ranks started by it would each be a world of one.
    """
    chosen = os.environ.get(MPIEXEC_ENV, "").strip()
    if chosen:
        return chosen
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec") or beside


def child_env() -> dict[str, str]:
    """This environment with hpcpipe's sources and bench/ importable (the carried MPI's paths are kept)."""
    path = [os.path.join(ROOT, "src"), BENCH, HERE, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1"}


class Budget:
    """Seconds left of the run's budget; each phase asks for its estimate before it starts."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left."""
        return self.end - time.monotonic()

    def allows(self, need: float) -> bool:
        """Whether a phase that takes about `need` seconds still fits."""
        return self.left() >= need


def run_logged(cmd: list[str], log: str, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run cmd (its own process group, killed at timeout), append its output to log; return (status, output)."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or child_env(), cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        out += f"\n[killed after {timeout:.0f} s]"
    with open(log, "a") as f:
        f.write(out)
    return proc.returncode, out


def last_json(text: str) -> dict | None:
    """The last line of text that parses as a JSON object (workers print their result that way)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None
