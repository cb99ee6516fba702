"""GPT and Llama gradients at pp = 2 on the device backend (CuPy) against the NumPy path: the same initial weights
(model.seed) and token windows; float64 to 1e-10 and float32 to 1e-4 of each tensor's largest value, the loss
likewise. The GPT's head is tied across the two stages (the embedding's gradient crosses the pipeline once per
step); the Llama has grouped-query attention, q/k/v biases and llama3 RoPE scaling. On the device, a step that
stages through host memory (an MPI library that is not CUDA-aware) reports its copies in host_device_bytes;
NumPy reports none. Without a GPU these skip (HPCPIPE_GPU_REHEARSE=1: rehearsed on NumPy)."""

import pytest
from support.gpu import device_backend, load_arrays, relative_errors, run_worker, token_windows

pytestmark = pytest.mark.gpu

GPT = {"kind": "gpt", "vocab_size": 11, "seq_len": 6, "d_model": 8, "n_heads": 2, "n_blocks": 6, "d_ff": 12,
       "seed": 7, "tie_embeddings": True}
LLAMA = {"kind": "llama", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 4,
         "d_ff": 12, "qkv_bias": True, "rope_theta": 500000.0, "norm_eps": 1e-6, "seed": 7,
         "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 4}}
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
WINDOWS = 24


def _runs(tmp_path, device: str) -> list[dict]:
    runs = []
    for kind, model in (("gpt", GPT), ("llama", LLAMA)):
        data = token_windows(tmp_path / f"{kind}-tokens.h5", model["vocab_size"], model["seq_len"], WINDOWS)
        for dtype in TOLERANCE:
            sections = {"parallel": {"pp": 2, "dp": 1, "schedule": "1f1b"}, "model": {**model, "dtype": dtype},
                        "data": {"path": str(data)}, "train": {"micro_batches": 4, "micro_batch_size": WINDOWS // 4},
                        "checkpoint": {"dir": ""}}
            for side, backend in (("numpy", "numpy"), ("device", device)):
                runs.append({"name": f"{kind}-{dtype}-{side}", "backend": backend, "sections": sections})
    return runs


def test_gpt_and_llama_gradients_at_pp2_on_the_device_equal_numpy(tmp_path):
    device = device_backend()
    result = run_worker(2, "gradients", tmp_path, {"runs": _runs(tmp_path, device)}, timeout=600)
    report = {}
    for kind in ("gpt", "llama"):
        for dtype, tol in TOLERANCE.items():
            ref, dev = result[f"{kind}-{dtype}-numpy"], result[f"{kind}-{dtype}-device"]
            want = load_arrays(tmp_path / f"{kind}-{dtype}-numpy.npz")
            got = load_arrays(tmp_path / f"{kind}-{dtype}-device.npz")
            errors = relative_errors(got, want)
            worst = max(errors, key=errors.get)
            report[f"{kind} {dtype}"] = (worst, errors[worst], dev["host_device_bytes"])
            assert errors[worst] < tol, (kind, dtype, worst, errors[worst])
            assert abs(dev["loss"] - ref["loss"]) <= tol * abs(ref["loss"]), (kind, dtype, dev["loss"], ref["loss"])
            assert ref["host_device_bytes"] == 0
            assert dev["backend"] == device
    print("largest relative gradient error (tensor, error, host<->device bytes of the step, all ranks):", report)
