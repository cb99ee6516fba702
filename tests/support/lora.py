"""LoRA references for the tests: a tiny transformers llama with a PEFT adapter (random A and B), saved as a
Hugging Face directory and a PEFT directory, and PEFT + PyTorch autograd's loss and adapter gradients on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def float64_reference(model) -> None:
    """Make transformers' llama float64 throughout: its rotary embedding computes cos and sin in float32 and its
    RMSNorm the mean square in float32 even in a float64 model (1e-7 away from the contract's float64)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = (lambda m: lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                  + m.variance_epsilon) * m.weight)(module)
    rotary = model.model.rotary_emb
    if rotary.rope_type != "default":
        raise ValueError(f"float64_reference: rope type {rotary.rope_type!r}")
    params = getattr(rotary.config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(rotary.config, "rope_theta", 10000.0))
    hd = rotary.inv_freq.numel() * 2
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def forward(x, position_ids, *args, **kwargs):
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary.forward = forward


def make_model_and_adapter(directory: Path, targets: list[str] = ALL, rank: int = 4, alpha: float = 8.0,
                           seed: int = 0, **overrides) -> tuple[Path, Path]:
    """Save a tiny float32 llama (every parameter random) and a PEFT adapter with random A and B on it."""
    from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    base = tiny_model("llama", seed=seed, vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0, **overrides)
    hf_dir = save_model(base, directory / "base")
    save_tokenizer(tok, hf_dir, eos_token="<|endoftext|>")
    torch.manual_seed(seed + 1)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                        lora_dropout=0.0, init_lora_weights=False))
    with torch.no_grad():                 # PEFT's random B is tiny; make every adapter term count in the loss
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    adapter_dir = directory / "adapter"
    wrapped.save_pretrained(str(adapter_dir))
    return hf_dir, adapter_dir


def peft_model(hf_dir: Path, adapter_dir: Path, dtype=None):
    """transformers' model of hf_dir with the PEFT adapter loaded (float64 unless dtype), trainable adapters."""
    dtype = dtype or torch.float64
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype,
                                                             attn_implementation="sdpa").eval()
    if dtype == torch.float64:
        float64_reference(base)
    return peft.PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True).eval()


def peft_loss_and_grads(hf_dir: Path, adapter_dir: Path, x: np.ndarray, y: np.ndarray, kind_keys: dict):
    """(mean token cross-entropy, {group: {hpcpipe adapter name: gradient}}) of PEFT + PyTorch autograd."""
    from hpcpipe.nn.lora import peft_names
    from hpcpipe.nn.registry import KINDS
    model = peft_model(hf_dir, adapter_dir)
    logits = model(torch.as_tensor(x, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.as_tensor(y, dtype=torch.long).reshape(-1))
    loss.backward()
    grads = {name.replace(".default", ""): p.grad.detach().numpy() for name, p in model.named_parameters()
             if p.grad is not None}
    hf = KINDS["llama"].hf
    out = {}
    targets = tuple(model.peft_config["default"].target_modules)
    for i in range(1, kind_keys["n_blocks"] + 1):
        out[i] = {name: grads[peft].T for name, peft in peft_names(hf, kind_keys, i, targets).items()}
    return float(loss.detach()), out
