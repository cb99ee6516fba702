"""An independent Llama for the tests: PyTorch float64 autograd written directly from the contract's equations.

Not hpcpipe's code: the reference the hand-written forward and backward of the llama kind are checked against
(tests/nn/test_llama_against_references.py, the pipeline at every layout in
tests/train/test_llama_pipeline.py).
"""

import math

import pytest

torch = pytest.importorskip("torch")


def torch_inv_freq(hd, theta, scaling):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen < ctx / high, inv, torch.where(wavelen > ctx / low, inv / factor, mid))
    return inv


def load_balancing(probs, top_k, n_experts, chunks):
    """The mean over ``chunks`` equal runs of samples of transformers' load-balancing loss, from every sparse
    layer's router probabilities (batch, t, E): E sum_e (chosen_e / R)(summed p_e / R), R = layers x tokens."""
    total = 0.0
    for c in range(chunks):
        rows = [p[c * len(p) // chunks:(c + 1) * len(p) // chunks].reshape(-1, n_experts) for p in probs]
        every = torch.cat(rows)
        chosen = torch.nn.functional.one_hot(torch.topk(every, top_k, -1).indices, n_experts).sum((0, 1))
        total = total + n_experts * ((chosen / len(every)) * (every.sum(0) / len(every))).sum()
    return total / chunks


def torch_llama(shape, groups, tokens, targets, chunks=1):
    """(mean loss, grads by group, logits) of the contract's model in PyTorch float64 autograd; a mixture with
    router_aux_loss_coef adds it times the load-balancing loss averaged over ``chunks`` (replica x micro-batch)."""
    tg = [{k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in g.items()} for g in groups]
    n_h, n_kv, hd, eps = shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.norm_eps
    b, t = tokens.shape
    angles = torch.arange(t, dtype=torch.float64)[:, None] * torch_inv_freq(hd, shape.rope_theta,
                                                                             shape.rope_scaling)[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):                                     # (b, heads, t, hd), rotate_half
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def proj(u, p, name):
        y = u @ p[f"attn/{name}/weight"]
        return y + p[f"attn/{name}/bias"] if shape.qkv_bias else y

    def attn(u, p, window):
        q = proj(u, p, "q").reshape(b, t, n_h, hd).transpose(1, 2)
        k = proj(u, p, "k").reshape(b, t, n_kv, hd).transpose(1, 2)
        v = proj(u, p, "v").reshape(b, t, n_kv, hd).transpose(1, 2)
        if shape.qk_norm:                            # Qwen3: each head's q and k normalized before RoPE
            q, k = rmsnorm(q, p["attn/q_norm/weight"]), rmsnorm(k, p["attn/k_norm/weight"])
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(n_h // n_kv, dim=1)    # query head i uses kv head i // (n_heads / n_kv_heads)
        v = v.repeat_interleave(n_h // n_kv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        if window:                                   # a sliding window: the last ``window`` positions only
            causal &= ~torch.ones(t, t, dtype=torch.bool).tril(-window)
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, -1) @ v
        return out.transpose(1, 2).reshape(b, t, n_h * hd) @ p["attn/o/weight"]

    routers = []

    def experts(u, p):                               # a sparse mixture of experts, as transformers routes
        x = u.reshape(-1, u.shape[-1])
        probs = torch.softmax(x @ p["mlp/router/weight"], -1)
        routers.append(probs.reshape(*u.shape[:-1], -1))
        w, top = torch.topk(probs, shape.experts_per_token, dim=-1)
        if shape.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(shape.n_experts):
            rows, pick = torch.where(top == e)
            if len(rows):
                xe = x[rows]
                y = (torch.nn.functional.silu(xe @ p["mlp/experts/gate"][e]) * (xe @ p["mlp/experts/up"][e])) \
                    @ p["mlp/experts/down"][e]
                out = out.index_add(0, rows, w[rows, pick, None] * y)
        return out.reshape(u.shape)

    h = tg[0]["tok_emb"][torch.as_tensor(tokens)]
    for index, p in enumerate(tg[1:-1], start=1):
        a = h + attn(rmsnorm(h, p["attn_norm/weight"]), p, shape.window(index))
        u = rmsnorm(a, p["mlp_norm/weight"])
        if "mlp/router/weight" in p:
            h = a + experts(u, p)
            continue
        h = a + (torch.nn.functional.silu(u @ p["mlp/gate/weight"]) * (u @ p["mlp/up/weight"])) @ p["mlp/down/weight"]
    u = rmsnorm(h, tg[-1]["norm/weight"])
    logits = u @ (tg[0]["tok_emb"].T if shape.tied else tg[-1]["head/weight"])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, shape.vocab), torch.as_tensor(targets).reshape(-1))
    if routers and getattr(shape, "router_aux_loss_coef", 0):
        loss = loss + shape.router_aux_loss_coef * load_balancing(routers, shape.experts_per_token,
                                                                  shape.n_experts, chunks)
    loss.backward()
    return loss.item(), [{k: v.grad.numpy() for k, v in g.items()} for g in tg], logits.detach().numpy()
