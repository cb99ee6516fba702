"""serve's start line says what is served: the layout (ep included), the weight format the stages compute in and
an --adapter (a new-user run: it named only dp, pp and tp, so a q8_0 or adapted server looked like any other)."""

from __future__ import annotations

import json

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model

from hpcpipe.serve.command import layout_words
from hpcpipe.serve.setup import prepare


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny bf16 llama and a tiny mixtral (4 experts) with a 300-token tokenizer."""
    folder = tmp_path_factory.mktemp("hf")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    out = {}
    for arch, dtype in (("llama", "bfloat16"), ("mixtral", "float32")):
        model = tiny_model(arch, vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
        out[arch] = save_tokenizer(tok, save_model(model, folder / arch, dtype=dtype), eos_token="<|endoftext|>")
    return out


@pytest.mark.parametrize("fmt", ["float32", "stored", "q8_0"])
def test_line_names_the_weight_format(models, fmt):
    setup = prepare(models["llama"], 1, overrides=[f'model.weight_format="{fmt}"'])
    named = "as stored (16-bit)" if fmt == "stored" else fmt      # the llama is saved in bfloat16
    assert layout_words(setup) == f"dp=1 x pp=1, weights {named}"


def test_auto_is_named_as_what_it_became(models):
    from hpcpipe.kernels import cpu
    from hpcpipe.kernels.formats import INFERENCE_DEFAULT
    want = INFERENCE_DEFAULT if cpu.library() is not None else "float32"     # auto without compiled stages: float32
    want = "as stored (16-bit)" if want == "stored" else want
    setup = prepare(models["llama"], 2, overrides=["parallel.tp=2"])
    assert layout_words(setup) == f"dp=1 x pp=1 x tp=2, weights {want}"


def test_line_names_expert_parallelism(models):
    setup = prepare(models["mixtral"], 2, overrides=["parallel.ep=2"])
    assert layout_words(setup) == "dp=2 x pp=1, experts over ep=2, weights float32"


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("fmt", ["stored", "q8_0"])
def test_a_moe_model_s_line_says_its_matrices_are_float32_and_the_memory_check_counts_them_so(models, fmt, ep):
    """The moe kind runs the NumPy steps, which widen every matrix once read: the line said "weights q8_0" (or "as
    stored (16-bit)") and the memory check counted the attention matrices at 1.06 (or 2) bytes a value, 4 held."""
    from hpcpipe.serve.setup import format_bytes
    setup = prepare(models["mixtral"], ep, overrides=[f'model.weight_format="{fmt}"', f"parallel.ep={ep}"])
    values = "q8_0-rounded values, the experts' as stored" if fmt == "q8_0" else "the stored values"
    experts = ", experts over ep=2" if ep == 2 else ""
    assert layout_words(setup) == (f"dp={ep} x pp=1{experts}, weights float32 ({values}; this layout's NumPy steps "
                                   f"widen every matrix)")
    assert format_bytes(setup.config, setup.model, setup.weights) is None


def test_line_names_the_adapter(models, tmp_path):
    pytest.importorskip("peft")
    from support.lora import make_model_and_adapter
    base, adapter = make_model_and_adapter(tmp_path, targets=["q_proj"])
    setup = prepare(base, 1, overrides=[f"model.adapter={json.dumps(str(adapter))}"])
    assert layout_words(setup) == f"dp=1 x pp=1, weights as stored (float32), adapter {adapter}"   # merged sums


def test_auto_on_a_gpu_is_float32(models):
    """Stages on CuPy (run.backend "cupy", or "auto" where a GPU is seen) keep "auto" weights as float32."""
    from hpcpipe.serve.setup import kept_format
    setup = prepare(models["llama"], 1)
    assert kept_format(setup.config, setup.model, on_gpu=True) == "float32"
    assert kept_format(setup.config, setup.model, on_gpu=False) == kept_format(setup.config, setup.model)


def test_a_float64_model_is_named_float64(tmp_path):
    from support.serve import make_weights
    make_weights(tmp_path / "gpt.h5")                  # float64: the stages widen its weights to float64
    # was: "weights float32", for a model that decodes in float64 (docs/serve.md)
    assert layout_words(prepare(tmp_path / "gpt.h5", 1)) == "dp=1 x pp=1, weights float64"
    make_weights(tmp_path / "gpt32.h5", dtype="float32")
    assert layout_words(prepare(tmp_path / "gpt32.h5", 1)) in ("dp=1 x pp=1, weights float32",
                                                               "dp=1 x pp=1, weights as stored (float32)")
