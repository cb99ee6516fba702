"""What the test_llama_* layer files share: shapes, RoPE tables, layers and models of given parameters, and
parameters far from the init."""

import numpy as np

from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape, group_params


def model_rope(shape, xp, dtype):
    """The model's RoPE tables in ``dtype``."""
    return LlamaModel(shape).rope(xp, dtype)


def build_layer(shape, index, params, grads, xp, tok_emb=None, grad_tok_emb=None):
    """The llama layer of group ``index``."""
    return LlamaModel(shape).build_layer(index, params, grads, xp, tok_emb, grad_tok_emb)


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def random_groups(shape, rng, dtype="float64"):
    """Parameters far from the init (norm weights != 1, biases != 0) so every term counts."""
    groups = []
    for index in range(shape.n_groups):
        group = {}
        for name, dims in group_params(shape, index):
            value = rng.standard_normal(dims) * 0.3
            group[name] = (value + 1.0 if "norm/" in name else value).astype(dtype)
        groups.append(group)
    return groups


def loaded_model(shape, groups, dtype="float64"):
    """A Llama decoder in ``dtype`` holding the given parameter groups."""
    model = Decoder(LlamaModel(shape), np, dtype)
    for i, group in enumerate(groups):
        model.load_group(i, group)
    return model


CASES = {
    "gqa_tied_bias": LlamaShape(vocab=17, seq_len=8, d_model=16, n_heads=4, n_blocks=2, d_ff=24, tied=True,
                                n_kv_heads=2, qkv_bias=True),
    "mqa_untied_theta500k": LlamaShape(vocab=13, seq_len=7, d_model=16, n_heads=4, n_blocks=2, d_ff=20,
                                       n_kv_heads=1, rope_theta=500000.0),
    "mha_llama3": LlamaShape(vocab=11, seq_len=9, d_model=16, n_heads=2, n_blocks=1, d_ff=12, tied=True,
                             rope_scaling=LLAMA3, norm_eps=1e-6),
    "gqa_head_dim_linear": LlamaShape(vocab=19, seq_len=6, d_model=12, n_heads=4, n_blocks=2, d_ff=16,
                                      n_kv_heads=2, head_dim=6, qkv_bias=True,
                                      rope_scaling={"type": "linear", "factor": 2.5}),
    "mqa_llama3_500k_untied": LlamaShape(vocab=9, seq_len=8, d_model=8, n_heads=2, n_blocks=2, d_ff=10,
                                         n_kv_heads=1, rope_theta=500000.0, qkv_bias=True,
                                         rope_scaling=dict(LLAMA3, original_max_position_embeddings=8192)),
}


SPLIT_SHAPE = LlamaShape(vocab=11, seq_len=6, d_model=12, n_heads=4, n_blocks=1, d_ff=10, n_kv_heads=2,
                         head_dim=4, qkv_bias=True, rope_scaling=LLAMA3, tied=True)
