"""The memory check counts what a stage keeps: a bf16 checkpoint served as stored at 2 bytes a matrix value,
q8_0 at 34 bytes a block of 32, and serve.draft's whole model and KV pool on the first stage's rank.

Before, every parameter counted as float32, so a model that fits only as stored (the reason to serve it so)
was refused, and a draft model's bytes were not counted at all.
"""

import math

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model

from hpcpipe.errors import ConfigError
from hpcpipe.kernels import cpu
from hpcpipe.nn.memory import decode_rank_bytes
from hpcpipe.serve.setup import check_decode_memory, draft_bytes, format_bytes, prepare

pytest.importorskip("torch")
pytest.importorskip("transformers")

HIDDEN, FF = 64, 80          # down's input (80) is no whole number of q8_0 blocks: it stays as stored


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny untied Llama saved in bfloat16 and in float32, with a tokenizer; a smaller one as a draft."""
    root = tmp_path_factory.mktemp("memory-formats")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=FF,
                       tie_word_embeddings=False)
    out = {}
    for dtype in ("bfloat16", "float32"):
        out[dtype] = save_model(model, root / dtype, dtype)
        save_tokenizer(tok, out[dtype])
    draft = tiny_model("llama", seed=1, vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
                       num_hidden_layers=1, tie_word_embeddings=False)
    out["draft"] = save_model(draft, root / "draft", "bfloat16")
    save_tokenizer(tok, out["draft"])
    out["model"] = model
    return out


def _setup(directory, *more):
    return prepare(directory, 1, None, ["parallel.pp=1", "serve.max_sequences=4", *more])


def _block_values(model):
    """(matrix values, vector values) of the transformers model's decoder layers."""
    mats = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    vecs = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 1)
    return mats, vecs


def test_stored_counts_a_bf16_checkpoint_s_matrices_at_two_bytes(checkpoints):
    s = _setup(checkpoints["bfloat16"], 'model.weight_format="stored"')
    per_value = format_bytes(s.config, s.model, s.weights)
    assert per_value((HIDDEN, HIDDEN)) == 2
    float32 = decode_rank_bytes(s.config, s.stage_ranges)[0]
    stored = decode_rank_bytes(s.config, s.stage_ranges, per_value)[0]
    mats, _ = _block_values(checkpoints["model"])
    assert float32 - stored == mats * (4 - 2)
    again = _setup(checkpoints["float32"], 'model.weight_format="stored"')
    assert format_bytes(again.config, again.model, again.weights)((HIDDEN, HIDDEN)) == 4   # float32 as stored


def test_q8_0_counts_whole_blocks_at_34_bytes_and_the_rest_as_stored(checkpoints):
    s = _setup(checkpoints["bfloat16"], 'model.weight_format="q8_0"')
    per_value = format_bytes(s.config, s.model, s.weights)
    assert per_value((HIDDEN, 3 * HIDDEN)) == 34 / 32 and per_value((FF, HIDDEN)) == 2
    model = checkpoints["model"]
    down = sum(p.numel() for n, p in model.named_parameters() if n.endswith("mlp.down_proj.weight"))
    mats, _ = _block_values(model)
    float32 = decode_rank_bytes(s.config, s.stage_ranges)[0]
    q8 = decode_rank_bytes(s.config, s.stage_ranges, per_value)[0]
    assert float32 - q8 == pytest.approx((mats - down) * (4 - 34 / 32) + down * (4 - 2))


def test_float32_and_auto_count_as_the_engine_keeps_them(checkpoints):
    s = _setup(checkpoints["bfloat16"], 'model.weight_format="float32"')
    assert format_bytes(s.config, s.model, s.weights) is None
    auto = _setup(checkpoints["bfloat16"])
    per_value = format_bytes(auto.config, auto.model, auto.weights)
    if cpu.library() is None:       # "auto" widens to float32 without the compiled stage
        assert per_value is None
    else:
        assert per_value((HIDDEN, HIDDEN)) == 2


def test_a_model_that_fits_only_as_stored_is_served_stored_and_refused_in_float32(checkpoints):
    s = _setup(checkpoints["bfloat16"], 'model.weight_format="stored"')
    per_value = format_bytes(s.config, s.model, s.weights)
    stored, float32 = (sum(decode_rank_bytes(s.config, s.stage_ranges, b)) for b in (per_value, None))
    between = (stored + float32) // 2
    check_decode_memory(s.config, s.stage_ranges, 1, available=between, matrix_bytes=per_value)
    with pytest.raises(ConfigError, match="a rank needs about"):
        check_decode_memory(s.config, s.stage_ranges, 1, available=between)


def test_the_draft_model_and_its_kv_pool_count_on_the_first_stage_s_rank(checkpoints):
    s = _setup(checkpoints["bfloat16"], 'serve.speculate="draft"', f'serve.draft="{checkpoints["draft"]}"',
               "serve.kv_block=16")
    params, cache = draft_bytes(s.config, s.model, s.draft)
    d = s.draft.shape
    assert params == 4 * sum(math.prod(shape) for spec in s.draft.model.specs for shape in spec.shapes.values())
    assert cache == 2 * s.kv_blocks * 16 * d.n_blocks * d.n_kv_heads * d.head_dim * 4
    alone = sum(decode_rank_bytes(s.config, s.stage_ranges))
    check_decode_memory(s.config, s.stage_ranges, 1, available=alone + params + cache, draft=(params, cache))
    with pytest.raises(ConfigError, match=r"with serve.draft's model \(.* GiB\)"):
        check_decode_memory(s.config, s.stage_ranges, 1, available=alone + params + cache - 1,
                            draft=(params, cache))
    # at pp = 2 only the first stage's rank holds the draft
    two = prepare(checkpoints["bfloat16"], 2, None, ["parallel.pp=2", "serve.max_sequences=4", "serve.kv_block=16"])
    first, second = (sum(decode_rank_bytes(two.config, [r])) for r in two.stage_ranges)
    need = max(first + params + cache, second)
    check_decode_memory(two.config, two.stage_ranges, 1, available=need, draft=(params, cache))
    with pytest.raises(ConfigError):
        check_decode_memory(two.config, two.stage_ranges, 1, available=need - 1, draft=(params, cache))


def test_auto_on_a_gpu_checks_no_host_memory_as_cupy_does_not(checkpoints, monkeypatch):
    """run.backend = "auto" where a GPU is seen checked the stages' weights against host memory, where they are not
    (run.backend = "cupy" skipped it): a model that fits the GPU was refused by the host's RAM."""
    from hpcpipe.runtime import backend
    s = _setup(checkpoints["bfloat16"], 'model.weight_format="stored"')
    with pytest.raises(ConfigError, match="a rank needs about"):
        check_decode_memory(s.config, s.stage_ranges, 1, available=1000)
    monkeypatch.setattr(backend, "_gpu_count", lambda: 1)     # this host has none: the choice is what is checked
    assert s.config.run.backend == "auto" and format_bytes(s.config, s.model, s.weights) is None
    check_decode_memory(s.config, s.stage_ranges, 1, available=1000)


@pytest.mark.skipif(cpu.library() is None, reason="without the compiled stage every format is held as float32")
def test_a_bf16_checkpoint_widened_to_float32_that_does_not_fit_is_told_the_format_that_fits(checkpoints):
    """serve --set model.weight_format='"float32"' of a bf16 model that fits only as stored said "the parameters
    alone do not fit: use more stages": more ranks, where keeping the checkpoint's own 2 bytes a value fits."""
    s = _setup(checkpoints["bfloat16"], 'model.weight_format="float32"')
    stored = format_bytes(_setup(checkpoints["bfloat16"], 'model.weight_format="stored"').config, s.model, s.weights)
    need_stored = sum(decode_rank_bytes(s.config, s.stage_ranges, stored))
    check_decode_memory(s.config, s.stage_ranges, 1, available=need_stored, matrix_bytes=stored)     # it fits
    with pytest.raises(ConfigError) as info:
        check_decode_memory(s.config, s.stage_ranges, 1, available=need_stored, smaller={"stored": stored})
    assert "keep the matrices in weight format stored (--set model.weight_format='\"stored\"'" in str(info.value)
    from hpcpipe.serve.setup import smaller_formats
    assert set(smaller_formats(s.config, s.model, s.weights)) == {"stored", "q8_0"}
    q8 = _setup(checkpoints["bfloat16"], 'model.weight_format="q8_0"')
    assert smaller_formats(q8.config, q8.model, q8.weights) == {}          # nothing smaller than q8_0
    f32 = _setup(checkpoints["float32"], 'model.weight_format="float32"')
    assert set(smaller_formats(f32.config, f32.model, f32.weights)) == {"q8_0"}   # float32 as stored saves nothing
    # at tp = 2 a rank's slice of down's input (80 / 2) is no whole q8_0 block: q8_0 is refused there, not offered
    tp = prepare(checkpoints["bfloat16"], 2, None, ["parallel.tp=2", "serve.max_sequences=4",
                                                    'model.weight_format="float32"'])
    assert set(smaller_formats(tp.config, tp.model, tp.weights)) == {"stored"}
