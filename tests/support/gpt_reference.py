"""An independent GPT for the tests: JAX autograd written directly from the contract's equations."""

import math

import numpy as np


def jax_gpt(shape, groups, tokens, targets):
    """(mean loss, grads by group) of the contract's GPT in JAX float64, from groups of host arrays."""
    import jax
    import jax.numpy as jnp

    d, n_heads = shape.d_model, shape.n_heads
    d_head = d // n_heads

    def layer_norm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)           # biased
        return (x - mean) / jnp.sqrt(var + 1e-5) * w + b

    def gelu_tanh(x):
        return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    def attn(u, p):
        b, t, _ = u.shape
        qkv = u @ p["attn/qkv/weight"] + p["attn/qkv/bias"]
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        heads = []
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        for h in range(n_heads):
            cols = slice(h * d_head, (h + 1) * d_head)
            scores = q[..., cols] @ jnp.swapaxes(k[..., cols], -1, -2) / math.sqrt(d_head)
            scores = jnp.where(causal, scores, -jnp.inf)
            heads.append(jax.nn.softmax(scores, axis=-1) @ v[..., cols])
        return jnp.concatenate(heads, axis=-1)

    def loss(groups):
        t = tokens.shape[1]
        h = groups[0]["tok_emb"][tokens] + groups[0]["pos_emb"][0:t]
        for p in groups[1:-1]:
            a = h + attn(layer_norm(h, p["ln1/weight"], p["ln1/bias"]), p) @ p["attn/proj/weight"] \
                + p["attn/proj/bias"]
            u = layer_norm(a, p["ln2/weight"], p["ln2/bias"])
            h = a + gelu_tanh(u @ p["mlp/fc/weight"] + p["mlp/fc/bias"]) @ p["mlp/proj/weight"] + p["mlp/proj/bias"]
        final = groups[-1]
        u = layer_norm(h, final["ln_f/weight"], final["ln_f/bias"])
        logits = u @ (groups[0]["tok_emb"].T if shape.tied else final["head/weight"])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    jgroups = [{k: jnp.asarray(v, dtype=jnp.float64) for k, v in g.items()} for g in groups]
    value, grads = jax.value_and_grad(loss)(jgroups)
    return float(value), [{k: np.asarray(v) for k, v in g.items()} for g in grads]
