"""On a GPU node serve's start line names the weight format the CuPy stages keep: run.backend = "auto" (the
default) runs on CuPy there, where "auto" weights widen to float32, and the line said "as stored (16-bit)"."""

import pytest
from support.gpu import cupy_missing
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model

from hpcpipe.serve.command import layout_words
from hpcpipe.serve.setup import prepare

pytestmark = pytest.mark.gpu


def test_auto_on_a_gpu_is_named_float32(tmp_path):
    missing = cupy_missing()
    if missing:
        pytest.skip(missing)
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
    path = save_tokenizer(tok, save_model(model, tmp_path / "llama", dtype="bfloat16"), eos_token="<|endoftext|>")
    setup = prepare(path, 1)            # run.backend = "auto": CuPy here, as serve.engine's select_backend picks
    assert setup.config.run.backend == "auto"
    assert layout_words(setup) == "dp=1 x pp=1, weights float32"
    stored = prepare(path, 1, overrides=['model.weight_format="stored"'])    # given, it is kept on the GPU too
    assert layout_words(stored) == "dp=1 x pp=1, weights as stored (16-bit)"
