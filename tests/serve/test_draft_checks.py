"""serve.draft's start-up checks name the fix that works (no MPI: what `serve` runs before any collective)."""

from __future__ import annotations

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import make_weights

from hpcpipe.errors import ConfigError
from hpcpipe.serve.setup import prepare


def draft_args(path) -> list[str]:
    return ["serve.speculate='draft'", f"serve.draft='{path}'"]


def test_a_draft_saved_in_another_dtype_is_named_as_the_draft(tmp_path):
    make_weights(tmp_path / "model.h5", seq_len=32)                       # float64
    make_weights(tmp_path / "draft.h5", seq_len=32, n_blocks=1, dtype="float32")
    with pytest.raises(ConfigError) as e:
        prepare(tmp_path / "model.h5", 1, None, draft_args(tmp_path / "draft.h5"))
    # was: "model.dtype = 'float64' in the configuration does not match weights file ..." (no config set it)
    assert str(e.value) == (f"serve.draft '{tmp_path / 'draft.h5'}' was saved in float32, but the model computes in "
                            f"float64: a draft decodes in the model's dtype; give a draft saved in float64")


def test_a_short_draft_of_a_gpt_does_not_suggest_a_shorter_model_seq_len(tmp_path):
    make_weights(tmp_path / "model.h5", seq_len=64)
    make_weights(tmp_path / "draft.h5", seq_len=32, n_blocks=1)
    with pytest.raises(ConfigError) as e:
        prepare(tmp_path / "model.h5", 1, None, draft_args(tmp_path / "draft.h5"))
    # was: "set model.seq_len to at most 32", which the GPT's weights then refuse ("does not match weights file")
    assert str(e.value).endswith("shorter than the model's 64: give a draft with a context of at least 64 tokens (the "
                                 "model's context is fixed by its weights)"), str(e.value)
    with pytest.raises(ConfigError, match="does not match weights file"):
        prepare(tmp_path / "model.h5", 1, None, [*draft_args(tmp_path / "draft.h5"), "model.seq_len=32"])


def test_a_short_draft_of_a_hugging_face_llama_suggests_the_seq_len_that_works(tmp_path):
    pytest.importorskip("transformers")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    for name, context in (("model", 128), ("draft", 64)):
        save_model(tiny_model("llama", vocab_size=tok.get_vocab_size(), max_position_embeddings=context),
                   tmp_path / name)
        save_tokenizer(tok, tmp_path / name)
    with pytest.raises(ConfigError, match="shorter than the model's 128: set model.seq_len to at most 64$"):
        prepare(tmp_path / "model", 1, None, draft_args(tmp_path / "draft"))
    assert prepare(tmp_path / "model", 1, None, [*draft_args(tmp_path / "draft"), "model.seq_len=64"]).draft


def test_a_draft_s_own_sampling_defaults_are_not_checked(tmp_path):
    """A draft proposes greedily: its generation_config.json is never read. Its values were checked as the model's
    (top_p 1.5 refused serve with 'serve.generation_config = "none"' as the fix, which the draft's own prepare
    never sees, so nothing turned it off)."""
    pytest.importorskip("transformers")
    import json
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    for name in ("model", "draft"):
        save_model(tiny_model("llama", vocab_size=tok.get_vocab_size(), max_position_embeddings=64), tmp_path / name)
        save_tokenizer(tok, tmp_path / name)
    (tmp_path / "draft" / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    assert prepare(tmp_path / "model", 1, None, draft_args(tmp_path / "draft")).draft is not None
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))     # the model's: checked
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p = 1.5 is not a number in \(0, 1\]"):
        prepare(tmp_path / "model", 1, None, draft_args(tmp_path / "draft"))
