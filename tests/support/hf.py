"""Builders for the tests of hpcpipe.hf (tests/hf/): tiny random transformers models and real tokenizers made in
the test (nothing is downloaded), and a text corpus with accents, emoji and CJK."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog pipeline stage rank tensor shard model token stream "
         "weights layer attention head embedding gradient schedule micro batch checkpoint resume").split()
EXOTIC = ["café", "naïve", "Ünïcödé", "résumé", "Straße", "😀", "🚀🔥", "👩‍💻", "日本語", "中文字符", "한국어",
          "Ελληνικά", "русский", "עברית", "العربية", "∑∫√", "—", "…", "\t", "  "]


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    """Return deterministic lines of mixed text for training tokenizers."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) if rng.random() < 0.8 else rng.choice(EXOTIC) for _ in range(rng.randint(3, 14))]
        line = " ".join(words)
        out.append(line.capitalize() + rng.choice([".", "!", "?", ",", ""]))
    return out


SAMPLES = ["Hello world", "the quick brown fox", "  leading and trailing  ", "multiple   spaces\tand\ttabs",
           "new\nlines\n\n", "café naïve résumé", "Ünïcödé — “quotes”", "emoji 😀 and 🚀🔥 and 👩‍💻",
           "日本語のテキスト", "中文字符 mixed with English", "한국어 Ελληνικά русский", "∑∫√ math", "",
           " ", "x", "don't won't I'm you're", "numbers 12345 67.89", "tokenizer pipeline stage rank!!!",
           "ŝ̷̢ţ̵r̶a̴n̷g̴e̵ combining marks", "\u200b zero width", "a" * 50]


def bytelevel_tokenizer(specials: list[str], vocab_size: int = 400, bos: str | None = None):
    """Return a trained byte-level BPE (GPT-2 / Llama 3 / Qwen2 style); with bos, a post-processor adds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def metaspace_tokenizer(vocab_size: int = 400):
    """Return a Llama-2 / Mistral style BPE with byte fallback (<0xNN> tokens), '▁' for spaces and BOS added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  limit_alphabet=60)
    trained.train_from_iterator(corpus(), trainer)
    # the 256 <0xNN> byte tokens belong to the model's vocabulary (not added tokens), right after the specials
    data = json.loads(trained.to_str())
    old = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    names = specials + [f"<0x{i:02X}>" for i in range(256)] + [t for t, _ in old if t not in specials]
    data["model"].update(vocab={t: i for i, t in enumerate(names)}, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def save_tokenizer(tok, directory: Path, config_extra: dict | None = None, **kwargs) -> Path:
    """Save a tokenizers.Tokenizer as transformers does (PreTrainedTokenizerFast.save_pretrained), then merge
    ``config_extra`` into tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(str(directory))
    if config_extra:
        path = Path(directory) / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config.update(config_extra)
        path.write_text(json.dumps(config, indent=2))
    return Path(directory)


def tiny_config(arch: str, **overrides):
    """Return the transformers config of a tiny model: vocab 100, hidden 32, 2 layers."""
    import transformers as T
    if arch == "gpt2":
        args = dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1)
        return T.GPT2Config(**{**args, **overrides})
    args = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    cls = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
           "mixtral": T.MixtralConfig, "qwen3_moe": T.Qwen3MoeConfig}[arch]
    if arch in ("mistral", "mixtral"):
        args["sliding_window"] = None
    if arch in ("qwen3", "qwen3_moe"):
        args["head_dim"] = 16
    if arch == "mixtral":
        args.update(num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        args.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
                    mlp_only_layers=[1], num_hidden_layers=3)
    return cls(**{**args, **overrides})


def tiny_model(arch: str, seed: int = 0, **overrides):
    """Return a tiny float32 causal LM of arch with every parameter random (biases and norms too), in eval mode.

    A Llama with attention_bias keeps its o_proj bias zero: hpcpipe's llama kind has no place for it.
    """
    import torch
    import transformers as T
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.bias"):
                p.zero_()
            elif "norm" in name or "ln_" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def save_model(model, directory: Path, dtype: str = "float32", shard: str | None = None) -> Path:
    """save_pretrained a copy of model in dtype (float32, float16, bfloat16), sharded when shard is a size."""
    import copy

    import torch
    copy_ = copy.deepcopy(model).to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard} if shard else {}
    copy_.save_pretrained(str(directory), **kwargs)
    return Path(directory)
