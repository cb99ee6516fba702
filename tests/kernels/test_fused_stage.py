"""A decode stage run by the compiled kernels (one call for every block) equals the NumPy steps (the reference):
GPT and llama variants, prompts and decode steps mixed in one call, split stages with a tied head, every weight
format, the AVX-512 and the portable paths (float32: within 1e-5 of the largest logit)."""

import numpy as np
import pytest

from hpcpipe.kernels import cpu
from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="compiled kernels not built (no C compiler)")

MODELS = {
    "gpt_tied": lambda: GPTModel(GPTShape(37, 24, 64, 4, 3, d_ff=96, tied=True)),
    "gpt_untied": lambda: GPTModel(GPTShape(37, 24, 32, 2, 2, tied=False)),
    "llama_gqa_bias_tied": lambda: LlamaModel(LlamaShape(41, 24, 64, 4, 3, d_ff=64, n_kv_heads=2, qkv_bias=True,
                                                         tied=True)),
    "llama_mqa_head_dim_scaled": lambda: LlamaModel(LlamaShape(41, 24, 64, 4, 2, d_ff=96, n_kv_heads=1, head_dim=32,
                                                               rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_odd_widths": lambda: LlamaModel(LlamaShape(29, 20, 24, 2, 2, d_ff=40, n_kv_heads=2, head_dim=12)),
    "qwen3_qk_norm": lambda: LlamaModel(LlamaShape(41, 24, 64, 4, 2, d_ff=96, n_kv_heads=2, head_dim=32,
                                                   qk_norm=True, tied=True, norm_eps=1e-6)),
    "mistral_window": lambda: LlamaModel(LlamaShape(41, 24, 64, 4, 3, d_ff=64, n_kv_heads=2, sliding_window=3,
                                                    sliding_layers=(0, 2))),
}


def _calls(vocab, rng):
    """Two prompts, decode steps of both, then a third prompt beside a decode step (one call mixes them)."""
    calls = [(rng.integers(0, vocab, 9), [Segment(2, 0, 5), Segment(0, 0, 4)])]
    for t in range(6):
        calls.append((rng.integers(0, vocab, 2), [Segment(0, 4 + t, 1), Segment(2, 5 + t, 1)]))
    calls.append((rng.integers(0, vocab, 4), [Segment(1, 0, 3), Segment(0, 10, 1)]))
    return calls


def _stages(model, arrays, splits, **options):
    """A decode stage for each range of layer groups (a tied head's stage gets the table), DecodeStage ``options``."""
    shape = model.shape
    stages = []
    for groups in splits:
        tok = arrays[0]["tok_emb"] if shape.tied and 0 not in groups and shape.n_groups - 1 in groups else None
        stages.append(DecodeStage(model, groups, arrays, np, "float32", 3, tok_emb=tok, **options))
    return stages


def _outputs(stages, calls):
    """Each call's output through the stages in turn."""
    out = []
    for x, segments in calls:
        for stage in stages:
            x = stage.forward(x, segments)
        out.append(x)
    return out


def _run(model, arrays, splits, fmt, compiled, calls):
    stages = _stages(model, arrays, splits, compiled=compiled, weight_format=fmt)
    assert all(s.compiled == compiled for s in stages)
    return _outputs(stages, calls)


@pytest.mark.parametrize("fmt", ["float32", "stored", "q8_0"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("portable", [False, True])
def test_the_compiled_stage_equals_the_numpy_steps(name, fmt, portable):
    int8 = cpu.int8_activations()
    cpu.use_portable(portable)
    cpu.int8_activations(False)     # q8_0 times float activations, as the NumPy steps; int8: test_q8_int8.py
    try:
        model = MODELS[name]()
        rng = np.random.default_rng(len(name))
        ref = Decoder(model, np, "float32", seed=3)
        arrays = {i: {k: np.array(v) + rng.standard_normal(v.shape).astype(np.float32) * 0.2 for k, v in g.items()}
                  for i, g in enumerate(ref.params)}
        calls = _calls(model.shape.vocab, rng)
        n = model.shape.n_groups
        for splits in ([range(n)], [range(0, 2), range(2, n)]):
            want = _run(model, arrays, splits, fmt, False, calls)
            got = _run(model, arrays, splits, fmt, True, calls)
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g.shape == w.shape
                assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (name, fmt, len(splits), step)
    finally:
        cpu.use_portable(False)
        cpu.int8_activations(int8)


def test_a_compiled_stage_clears_a_slot_and_refuses_what_it_cannot_run():
    model = MODELS["llama_gqa_bias_tied"]()
    arrays = {i: {k: np.array(v) for k, v in g.items()} for i, g in enumerate(Decoder(model, np, "float32").params)}
    stage = DecodeStage(model, range(model.shape.n_groups), arrays, np, "float32", 2)
    assert stage.compiled                              # the default on the CPU when the kernels are built
    stage.forward(np.array([1, 2, 3]), [Segment(1, 0, 3)])
    assert stage._cache[:, :, 1].any()
    stage.clear_slot(1)
    assert not stage._cache.any()
    with pytest.raises(ValueError, match="compiled kernels run NumPy float32 stages of a model"):
        DecodeStage(model, range(model.shape.n_groups), arrays, np, "float64", 2, compiled=True)
    with pytest.raises(ValueError, match="weight format 'int4' is not one of"):
        DecodeStage(model, range(model.shape.n_groups), arrays, np, "float32", 2, weight_format="int4")
    with pytest.raises(ValueError, match="segment start 0 \\+ length 30"):
        stage.forward(np.zeros(30, np.int64), [Segment(0, 0, 30)])
