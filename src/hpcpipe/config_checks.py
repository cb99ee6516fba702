"""Value ranges and cross-field rules of a configuration that do not depend on the world size, and the hint for a
list of strings written without TOML quotes."""

from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING, Any

from hpcpipe.errors import ConfigError
from hpcpipe.nn.registry import KINDS as _KINDS

if TYPE_CHECKING:
    from hpcpipe.config import Config, ModelConfig

LOSSES = ("mse", "cross_entropy")
OPTIMIZERS = ("sgd", "adam", "adamw")
BACKENDS = ("auto", "numpy", "cupy")
DTYPES = ("float32", "float64")
WEIGHT_FORMATS = ("auto", "float32", "stored", "q8_0")
RECOMPUTE = ("none", "stage")
LR_SCHEDULES = ("constant", "linear", "cosine")   # hpcpipe.train.lr_schedule


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Check value ranges and cross-field rules that do not depend on the world size."""
    from hpcpipe.schedule.registry import SCHEDULES

    par, mod, tr = config.parallel, config.model, config.train
    for axis in ("pp", "dp"):
        v = getattr(par, axis)
        _require(v == "auto" or (isinstance(v, int) and v >= 1),
                 f"parallel.{axis} must be a positive integer or \"auto\", got {v!r}")
    _require(not (par.pp == "auto" and par.dp == "auto"),
             "parallel.pp and parallel.dp cannot both be \"auto\"")
    _require(par.tp >= 1, f"parallel.tp must be a positive integer, got {par.tp!r}")
    _require(par.schedule in SCHEDULES,
             f"parallel.schedule {par.schedule!r} is not one of {', '.join(SCHEDULES)}")
    _require(par.virtual_stages >= 1, f"parallel.virtual_stages must be >= 1, got {par.virtual_stages}")
    _require(par.schedule != "zb-v" or par.virtual_stages == 2,
             f"parallel.schedule = \"zb-v\" places two model chunks per rank in a V and needs "
             f"parallel.virtual_stages = 2, got {par.virtual_stages}")
    _require(mod.kind in _KINDS, f"model.kind {mod.kind!r} is not one of {', '.join(_KINDS)}")
    kind = _KINDS[mod.kind]
    kind.validate(mod)
    if par.tp > 1:
        kind.validate_tp(mod, par.tp)
    _require(isinstance(par.ep, int) and par.ep >= 1, f"parallel.ep must be a positive integer, got {par.ep!r}")
    if par.ep > 1:
        kind.validate_ep(mod, par.ep)
    # a 16-bit checkpoint's users reach for model.dtype: it is the computation's type; the storage one is a format
    half = (" (the computation's type; a bfloat16 / float16 checkpoint is computed in float32, and generate, serve "
            "and evaluate keep its matrices as stored with model.weight_format = \"stored\", docs/kernels.md)"
            if mod.dtype in ("bfloat16", "float16", "bf16", "fp16", "half") else "")
    _require(mod.dtype in DTYPES, f"model.dtype {mod.dtype!r} is not one of {', '.join(DTYPES)}{half}")
    _require(mod.weight_format in WEIGHT_FORMATS,
             f"model.weight_format {mod.weight_format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    n_layers = config.n_layers
    if isinstance(par.pp, int):
        _require(par.pp * par.virtual_stages <= n_layers,
                 f"parallel.pp ({par.pp}) x parallel.virtual_stages ({par.virtual_stages}) exceeds "
                 f"the number of layers ({n_layers}) in {config.layers_text()}")
    if isinstance(par.stage_layers, str):
        _require(par.stage_layers == "profile",
                 f"parallel.stage_layers must be a list of layer counts or \"profile\", got {par.stage_layers!r}")
    elif par.stage_layers:
        _require(all(n >= 1 for n in par.stage_layers) and sum(par.stage_layers) == n_layers,
                 f"parallel.stage_layers {par.stage_layers} must be positive and sum to the number "
                 f"of layers ({n_layers})")
    _require(tr.steps >= 0, f"train.steps must be >= 0, got {tr.steps}")
    _require(tr.micro_batches >= 1, f"train.micro_batches must be >= 1, got {tr.micro_batches}")
    _require(tr.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {tr.micro_batch_size}")
    _require(tr.loss in LOSSES, f"train.loss {tr.loss!r} is not one of {', '.join(LOSSES)}")
    _require(tr.recompute in RECOMPUTE, f"train.recompute {tr.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    _require(mod.kind != "mlp" or tr.loss != "cross_entropy" or mod.dims[-1] >= 2,
             f"train.loss = \"cross_entropy\" needs at least 2 output classes, model.dims[-1] is {mod.dims[-1]}")
    _require(tr.optimizer in OPTIMIZERS, f"train.optimizer {tr.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    _require(tr.lr > 0, f"train.lr must be > 0, got {tr.lr}")
    _require(0 <= tr.momentum < 1, f"train.momentum must be in [0, 1), got {tr.momentum}")
    _require(tr.weight_decay >= 0, f"train.weight_decay must be >= 0, got {tr.weight_decay}")
    _require(tr.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = off), got {tr.grad_clip}")
    _require(0 <= tr.beta1 < 1 and 0 <= tr.beta2 < 1,
             f"train.beta1/beta2 must be in [0, 1), got {tr.beta1}/{tr.beta2}")
    _require(tr.eps > 0, f"train.eps must be > 0, got {tr.eps}")
    _require(tr.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {tr.max_bad_steps}")
    _validate_recipes(config)
    for key, seed in (("model.seed", mod.seed), ("data.seed", config.data.seed)):
        _require(seed >= 0, f"{key} must be >= 0, got {seed}")
    _require(config.data.synthetic_samples >= 1,
             f"data.synthetic_samples must be >= 1, got {config.data.synthetic_samples}")
    _require(config.checkpoint.every >= 0, f"checkpoint.every must be >= 0, got {config.checkpoint.every}")
    _require(config.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1, got {config.checkpoint.keep}")
    _require(not config.checkpoint.resume or bool(config.checkpoint.dir),
             "checkpoint.resume = true needs checkpoint.dir (it resumes from checkpoint.dir/latest)")
    inf = config.infer
    _require(inf.micro_batch_size >= 1, f"infer.micro_batch_size must be >= 1, got {inf.micro_batch_size}")
    _require(inf.buffers >= 1, f"infer.buffers must be >= 1, got {inf.buffers}")
    _require(bool(inf.x) and bool(inf.y), f"infer.x and infer.y must name datasets, got {inf.x!r} and {inf.y!r}")
    srv = config.serve
    for key in ("max_sequences", "max_queue"):
        _require(getattr(srv, key) >= 1, f"serve.{key} must be >= 1, got {getattr(srv, key)}")
    _require(srv.prefill_tokens >= 0,
             f"serve.prefill_tokens must be >= 0 (0 = whole prompts), got {srv.prefill_tokens}")
    _require(srv.micro_batches >= 0, f"serve.micro_batches must be >= 0 (0 = parallel.pp), got {srv.micro_batches}")
    # each group owns a block of the slots: more groups than slots would leave some groups without any
    _require(srv.micro_batches <= srv.max_sequences,
             f"serve.micro_batches ({srv.micro_batches}) must be <= serve.max_sequences ({srv.max_sequences}): each "
             f"group is a block of KV-cache slots, so {srv.micro_batches - srv.max_sequences} of the groups would "
             f"hold none; lower serve.micro_batches or raise serve.max_sequences")
    _require(srv.kv_block >= 1, f"serve.kv_block must be >= 1 (positions per KV block), got {srv.kv_block}")
    _require(srv.kv_blocks >= 0, f"serve.kv_blocks must be >= 0 (0 = serve.max_sequences whole contexts), got "
                                 f"{srv.kv_blocks}")
    _require(srv.speculate in ("", "ngram", "draft"),
             f"serve.speculate must be '', 'ngram' or 'draft', got {srv.speculate!r}")
    _require(srv.generation_config in ("auto", "none"), f"serve.generation_config must be 'auto' (the model's "
             f"sampling defaults) or 'none', got {srv.generation_config!r}")
    _require(1 <= srv.speculate_tokens <= 16, f"serve.speculate_tokens must be in 1..16, got {srv.speculate_tokens}")
    _require(srv.speculate != "draft" or bool(srv.draft),
             "serve.speculate = 'draft' needs serve.draft (a Hugging Face model directory with the same tokenizer)")
    _require(not srv.draft or srv.speculate == "draft",
             f"serve.draft {srv.draft!r} is used only with serve.speculate = 'draft' (it is {srv.speculate!r}): set "
             f"serve.speculate = \"draft\", or leave out serve.draft")
    _require(config.log.every >= 1, f"log.every must be >= 1, got {config.log.every}")
    _require(config.run.backend in BACKENDS,
             f"run.backend {config.run.backend!r} is not one of {', '.join(BACKENDS)}")
    _require(0 < config.run.poll_min_us <= config.run.poll_max_us,
             f"run.poll_min_us ({config.run.poll_min_us}) must be > 0 and <= run.poll_max_us "
             f"({config.run.poll_max_us})")
    _require(config.run.stall_timeout >= 0,
             f"run.stall_timeout must be >= 0 seconds (0 = no watchdog), got {config.run.stall_timeout}")


def _validate_recipes(config: Config) -> None:
    """The learning-rate schedule, ZeRO, LoRA and held-out evaluation keys (docs/recipes.md)."""
    tr = config.train
    _require(tr.lr_schedule in LR_SCHEDULES,
             f"train.lr_schedule {tr.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    _require(tr.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {tr.warmup_steps}")
    _require(0 <= tr.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {tr.min_lr_ratio}")
    _require(tr.min_lr_ratio == 0 or tr.lr_schedule != "constant",
             f"train.min_lr_ratio = {tr.min_lr_ratio} is where linear and cosine decay end; train.lr_schedule = "
             f"\"constant\" never decays (set train.lr_schedule = \"cosine\" or \"linear\", or drop min_lr_ratio)")
    _require(tr.zero in (0, 1), f"train.zero must be 0 or 1, got {tr.zero}")
    _require(not tr.zero or tr.optimizer != "sgd" or tr.momentum > 0,
             f"train.zero = 1 shards the optimizer state over the data-parallel replicas, and train.optimizer = "
             f"\"sgd\" with train.momentum = {tr.momentum} keeps none: nothing to shard (set train.momentum > 0, use "
             f"adam or adamw, or leave train.zero = 0)")
    # the experts' gradients are averaged over their own replicas only, which ZeRO's blocks and LoRA's frozen
    # buffer do not follow yet
    _require(config.parallel.ep == 1 or not tr.zero,
             f"train.zero = 1 with parallel.ep = {config.parallel.ep} is not supported (experts are averaged over "
             f"their own replicas only): set train.zero = 0 or parallel.ep = 1")
    _require(config.parallel.ep == 1 or not tr.lora_rank,
             f"train.lora_rank = {tr.lora_rank} with parallel.ep = {config.parallel.ep} is not supported: set "
             f"parallel.ep = 1 for LoRA")
    _require(tr.lora_rank >= 0, f"train.lora_rank must be >= 0 (0 = no LoRA), got {tr.lora_rank}")
    _require(tr.lora_alpha > 0, f"train.lora_alpha must be > 0, got {tr.lora_alpha}")
    _require(len(set(tr.lora_targets)) == len(tr.lora_targets),
             f"train.lora_targets names a module twice: {tr.lora_targets}")
    _require(tr.lora_rank > 0 or not tr.lora_targets,
             f"train.lora_targets = {tr.lora_targets} needs train.lora_rank > 0 (the adapters' rank)")
    if tr.lora_rank:      # a kind without those modules, or a target it does not have: one line naming them
        from hpcpipe.nn.lora import settings_of
        settings_of(tr, _KINDS[config.model.kind].hf, config.to_dict()["model"], config.model.kind)
    _require(tr.eval_every >= 0, f"train.eval_every must be >= 0 (0 = only at the end), got {tr.eval_every}")
    _require(not tr.eval_every or bool(config.data.eval_path),
             f"train.eval_every = {tr.eval_every} needs data.eval_path (the held-out HDF5 file to evaluate)")


def ep_splits(mod: ModelConfig, ep: int) -> bool:
    """Whether the model's experts split over ep expert-parallel ranks (the planner's filter; parallel.ep's checks)."""
    try:
        _KINDS[mod.kind].validate_ep(mod, ep)
    except ConfigError:
        return False
    return True


def tp_splits(mod: ModelConfig, tp: int) -> bool:
    """Whether the model splits over tp tensor-parallel ranks (the planner's filter; parallel.tp's checks)."""
    try:
        _KINDS[mod.kind].validate_tp(mod, tp)
    except ConfigError:
        return False
    return True


# the union types in words: "parallel.pp must be int | str, got 2.0" read as Python, not as the TOML to write
UNION_WORDS = {"int | str": 'a positive integer or "auto"',
               "list[int] | str": 'a list of layer counts or "profile"'}


def toml_hint(where: str, text: str, value: Any) -> str:
    """A hint when a list of strings came as one string "[q_proj]": TOML (and so --set) needs each quoted; and when
    a number came as a string (".1", "1.", a quoted "0.1"): TOML writes numbers bare, with a digit each side of '.'."""
    if text in ("int", "float") and isinstance(value, str) and "_" not in value:   # Python's 1_0 is no guide
        try:
            number = float(value)
        except ValueError:
            return ""
        if not math.isfinite(number) or (text == "int" and not number.is_integer()):
            return ""
        shown = int(number) if text == "int" else number
        return f" (not a TOML number; write --set {where}={shown}, or {where.split('.')[-1]} = {shown} in the file)"
    if not (text.startswith("list[str]") and isinstance(value, str) and value.strip().startswith("[")):
        return ""
    items = [item.strip().strip("'\"") for item in value.strip().strip("[]").split(",") if item.strip()]
    example = "[" + ", ".join(f'"{item}"' for item in items) + "]"
    return f" (TOML strings in a list need quotes: --set '{where}={example}', or {where} = {example} in the file)"


def unknown_section(name: str, value: Any, keys: dict[str, list[str]]) -> ConfigError:
    """The refusal of a section name the config does not have ({section: its keys} are the known ones): the closest
    section, or, for a key written above the first [section] header (steps = 5), the section it belongs in."""
    homes = [section for section, names in keys.items() if name in names]
    if homes and not isinstance(value, dict):
        return ConfigError(f"key {name!r} is outside any section: write it under [{homes[0]}] (TOML keys before the "
                           f"first [section] header belong to none)")
    close = difflib.get_close_matches(name.lower(), list(keys), n=1)    # [TRAIN]: [train]
    hint = f": did you mean [{close[0]}]?" if close else ""
    return ConfigError(f"unknown section [{name}]{hint} (known sections: {', '.join(keys)})")
