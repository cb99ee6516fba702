"""A checkpoint whose block matrices are stored in different float dtypes (k_proj kept in float32 beside bfloat16
ones, as a hand-merged adapter leaves it; or float16 beside bfloat16): the compiled stage stacks q | k | v into
one product, and with the default weight format ("auto" = stored) generate failed with "cannot build stage 0:
ValueError: stacked: parts of kinds ['bfloat16', 'float32'] ... differ". Now the mixed parts are widened to float32
(exact) and the text is transformers'; the memory check counts such a checkpoint's matrices at 4 bytes."""

from __future__ import annotations

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MIXES = {"k_proj float32": ("k_proj", torch.float32), "q_proj float16": ("q_proj", torch.float16)}


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """A tiny Qwen3 saved in bfloat16, and copies with one matrix kind rewritten in another dtype."""
    root = tmp_path_factory.mktemp("mixed")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("qwen3", vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
    out = {}
    for name, (which, dtype) in {"bf16": ("", None), **MIXES}.items():
        d = save_model(model, root / name.replace(" ", "-"), dtype="bfloat16")
        save_tokenizer(tok, d, eos_token="<|endoftext|>")
        if which:
            path = d / "model.safetensors"
            tensors = safetensors_torch.load_file(str(path))
            tensors = {k: v.to(dtype) if which in k else v for k, v in tensors.items()}
            safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
        out[name] = d
    return out


def _transformers_greedy(directory, prompt: str, n: int) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("fmt", ["auto", "stored", "q8_0"])
def test_a_mixed_dtype_checkpoint_generates(tmp_path, directories, mix, fmt):
    proc, result = generate(tmp_path, 1, directories[mix], "the quick brown", "--temperature", "0",
                            "--max-new-tokens", "12", "--set", f'model.weight_format="{fmt}"')
    assert proc.returncode == 0, proc.stderr
    if fmt != "q8_0":        # stored values widened exactly: transformers' float32 text of the same weights
        assert result["tokens"][:12] == _transformers_greedy(directories[mix], "the quick brown", 12)


def test_the_memory_check_counts_a_mixed_checkpoint_s_matrices_at_4_bytes(directories):
    from hpcpipe.state.sources import resolve_weights
    assert resolve_weights(directories["bf16"]).matrix_itemsize() == 2
    for mix in MIXES:
        assert resolve_weights(directories[mix]).matrix_itemsize() == 4, mix
