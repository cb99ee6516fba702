"""What the GPU checks (tests/gpu, marked ``gpu``) share: which backend plays the device, their workers under
mpiexec, small decoder weights files, and how two runs' arrays are compared.

Each check runs the same work twice, once on the NumPy backend and once on the device backend, and compares.
The device backend is CuPy when CuPy sees a GPU. Without one the checks skip, saying why; with
``HPCPIPE_GPU_REHEARSE=1`` they run anyway with NumPy in the device's place (both sides then agree by
construction, but every worker, launch, file and comparison runs: a rehearsal before a GPU lease,
bench/gpu/check.sh).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from support import ROOT, launchers
from support.launch import run

REHEARSE = "HPCPIPE_GPU_REHEARSE"
WORKER = ROOT / "tests" / "gpu" / "gpu_worker.py"
CHARS = " abcdefghijklmnopqrstuvwxyz.,!?'"


def cupy_missing() -> str:
    """Why CuPy cannot compute here ('' when it sees a GPU)."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:   # no driver, no device
        return f"CuPy sees no GPU ({type(exc).__name__}: {exc})"
    return "" if count else "CuPy sees no GPU"


def device_backend() -> str:
    """The backend that plays the device: 'cupy' with a GPU, 'numpy' in a rehearsal; otherwise skip the test."""
    why = cupy_missing()
    if not why:
        return "cupy"
    if os.environ.get(REHEARSE) == "1":
        return "numpy"
    import pytest
    pytest.skip(f"needs a CUDA GPU and CuPy: {why} ({REHEARSE}=1 rehearses these checks on NumPy)")


def run_worker(n: int, task: str, out: Path, spec: dict, timeout: float = 300) -> dict:
    """Run ``mpiexec -n n python tests/gpu/gpu_worker.py TASK SPEC.json OUT_DIR``; return the result JSON rank 0 wrote.

    The spec is a JSON-able dict the task reads (config sections, backends, paths); arrays come back as
    OUT_DIR/<name>.npz files named in the result.
    """
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / f"{task}-spec.json"
    spec_path.write_text(json.dumps(spec))
    argv = [*launchers.prefix(n), sys.executable, str(WORKER), task, str(spec_path), str(out)]
    proc = run(argv, timeout=timeout, env={"PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, f"{task} worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads((out / f"{task}-result.json").read_text())


def load_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz file the worker wrote, by 'group/name' key."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def relative_errors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, float]:
    """Per array: max |got - want| / max |want| (0 when both are all zero); the keys must match."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    out = {}
    for key, ref in want.items():
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        diff = float(np.max(np.abs(got[key].astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
        out[key] = diff / scale if scale else diff
    return out


def token_windows(path: Path, vocab: int, seq_len: int, rows: int, seed: int = 5) -> Path:
    """Write an HDF5 token file (x, y: rows x seq_len int32), targets partly predictable from the inputs."""
    import h5py
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (rows, seq_len))
    y = np.where(rng.random(x.shape) < 0.5, (x * 3 + 1) % vocab, rng.integers(0, vocab, x.shape))
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x.astype(np.int32), y.astype(np.int32)
    return path


def llama_config(vocab: int, seq_len: int = 32, d_model: int = 16, n_heads: int = 4, n_kv_heads: int = 2,
                 n_blocks: int = 4, dtype: str = "float64") -> dict:
    """A small Llama-shaped [model] section: grouped-query attention, RoPE, RMSNorm, SwiGLU, untied head."""
    return {"kind": "llama", "vocab_size": vocab, "seq_len": seq_len, "d_model": d_model, "n_heads": n_heads,
            "n_kv_heads": n_kv_heads, "n_blocks": n_blocks, "d_ff": 0, "tie_embeddings": False, "head_dim": 0,
            "rope_theta": 10000.0, "rope_scaling": {}, "norm_eps": 1e-5, "qkv_bias": False, "dtype": dtype}


def make_llama_weights(path: str | Path, seed: int = 3, **shape) -> Path:
    """Write a small Llama (chars tokenizer; weights drawn larger than at init, so greedy choices are clear)."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.llama.model import LlamaModel, llama_shape
    from hpcpipe.state.weights import write_weights
    config = llama_config(len(CHARS), **shape)
    m = llama_shape(from_dict({"model": config, "parallel": {"pp": 1}}).model)
    rng = np.random.default_rng(seed)
    groups = {}
    for i in range(m.n_groups):
        group = LlamaModel(m).init_group(i, seed, config["dtype"])
        groups[i] = {k: v + (0.3 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in group.items()}
    write_weights(path, groups, n_layers=m.n_groups, model_config=config,
                  attrs={"tokenizer": json.dumps({"kind": "chars", "chars": CHARS})})
    return Path(path)
