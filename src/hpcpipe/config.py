"""Configuration: TOML file + ``--set section.key=value`` overrides -> frozen, validated Config.

Every key has a default (the embedded default job), unknown sections and keys
are errors, and every value is type-checked. Nothing here touches MPI: the
world size is an argument, so a bad configuration is refused before the first
collective.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from hpcpipe.config_checks import UNION_WORDS, toml_hint, unknown_section, validate
from hpcpipe.errors import ConfigError
from hpcpipe.nn.registry import KINDS as _KINDS
from hpcpipe.nn.registry import decoders, model_keys

# the [model] keys each kind reads (its folder declares them): setting a key another kind reads is an error
KINDS = tuple(_KINDS)
KIND_KEYS = {name: kind.key_names for name, kind in _KINDS.items()}
DECODERS = decoders()    # language models: token data, a tokenizer, cross-entropy over tokens, generate/serve
KIND_NAMES = {name: kind.title for name, kind in _KINDS.items()}


@dataclass(frozen=True)
class ParallelConfig:
    pp: int | str = 4
    dp: int | str = "auto"
    tp: int = 1                # tensor-parallel ranks per stage: world = dp x pp x tp
    ep: int = 1                # expert-parallel: each MoE block's experts split over ep consecutive dp replicas
    schedule: str = "gpipe"
    virtual_stages: int = 1
    # explicit layers per stage; [] = balance by FLOPs; "profile" = balance by this host's measured costs
    stage_layers: list[int] | str = field(default_factory=list)


def _model_field(key: Any) -> tuple[str, Any, Any]:
    """A dataclass field (name, type, field) of a kind's [model] key; lists and dicts get a fresh copy each."""
    if isinstance(key.default, list | dict):
        return key.name, key.type, field(default_factory=lambda default=key.default: copy.deepcopy(default))
    return key.name, key.type, field(default=key.default)


# [model]: kind, every kind's own keys (hpcpipe.nn.<kind>.keys: the kinds are the one place that names them), and
# what every kind has: init (weights to start from), seed (initial weights depend on it and the layer only), dtype,
# weight_format (how generate, serve and evaluate keep the weights: hpcpipe.kernels.formats; training keeps float32)
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [("kind", str, field(default="mlp")), *(_model_field(key) for key in model_keys()),
     ("init", str, field(default="")), ("seed", int, field(default=0)), ("dtype", str, field(default="float32")),
     ("weight_format", str, field(default="auto")),
     # a PEFT LoRA adapter directory: trained further (train.lora_*), or served on the base (generate/serve --adapter)
     ("adapter", str, field(default=""))],
    frozen=True)
ModelConfig.__module__ = __name__


@dataclass(frozen=True)
class DataConfig:
    path: str = ""
    x: str = "x"
    y: str = "y"
    shuffle: bool = False
    seed: int = 0
    synthetic_samples: int = 4096
    eval_path: str = ""        # held-out HDF5 file (datasets x and y): its loss every train.eval_every steps


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    micro_batches: int = 8
    micro_batch_size: int = 4
    loss: str = "mse"
    optimizer: str = "sgd"
    lr: float = 0.001
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_bad_steps: int = 5     # skipped (non-finite) steps in a row before the run stops with exit 77
    recompute: str = "none"    # "stage": keep only each stage's input per micro-batch, re-run its forward
    lr_schedule: str = "constant"   # constant | linear | cosine, after train.warmup_steps of linear warmup from 0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # linear and cosine decay end at lr x min_lr_ratio (transformers' cosine_with_min_lr)
    zero: int = 0              # 1: Adam(W)'s moments / SGD's momentum and the update sharded over the dp replicas
    lora_rank: int = 0         # > 0: train LoRA adapters of this rank on lora_targets; the base stays frozen
    lora_alpha: float = 8.0    # the adapters' output is scaled by lora_alpha / lora_rank (PEFT's default 8)
    lora_targets: list[str] = field(default_factory=list)   # PEFT's target_modules; [] = the kind's PEFT default
    eval_every: int = 0        # steps between held-out losses over data.eval_path (0 = only at the end)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "checkpoints"   # "" = never save
    every: int = 0             # save every N steps; 0 = only at the end
    keep: int = 2              # committed checkpoints kept (never the one `latest` names)
    resume: bool = False       # start from dir/latest: parameters, optimizer, step, data position


@dataclass(frozen=True)
class LogConfig:
    every: int = 1
    metrics: str = ""
    trace: str = ""
    progress: bool = True


@dataclass(frozen=True)
class InferConfig:
    micro_batch_size: int = 128   # rows per micro-batch streamed through the pipeline
    x: str = "x"                  # input dataset (N, model.dims[0])
    y: str = "y"                  # output dataset written (N, model.dims[-1])
    buffers: int = 2              # micro-batches in flight per pipeline link (2 = double buffering)


@dataclass(frozen=True)
class ServeConfig:
    max_sequences: int = 32      # KV-cache slots per replica: sequences decoding at once
    micro_batches: int = 0       # groups the running sequences are spread over (0 = pp: every stage busy)
    max_queue: int = 256         # requests waiting for a slot; one more is answered 429
    kv_cache: bool = True        # false: recompute the whole prefix for every token (the baseline)
    prefill_tokens: int = 128    # prompt tokens one work item carries at most (longer prompts: in chunks); 0 = all
    model_name: str = ""         # id in /v1/models and responses; "" = the weights' file or directory name
    kv_block: int = 16           # positions per KV-cache block (paged cache: docs/serve.md)
    kv_blocks: int = 0           # KV blocks per stage's pool; 0 = max_sequences whole contexts (or windows)
    prefix_cache: bool = True    # reuse the KV blocks of a prompt prefix another request computed
    speculate: str = ""          # "" | "ngram" (prompt lookup) | "draft" (serve.draft's model) proposals
    speculate_tokens: int = 4    # tokens proposed per step and verified in one pass
    draft: str = ""              # a smaller model with the same tokenizer (Hugging Face directory)
    generation_config: str = "auto"   # "auto": requests default to the model's sampling settings | "none"


@dataclass(frozen=True)
class RunConfig:
    backend: str = "auto"
    poll_min_us: float = 20.0   # first sleep of a waiting rank; doubles up to poll_max_us
    poll_max_us: float = 1000.0
    stall_timeout: float = 600.0   # seconds without a finished step (or save) before the watchdog aborts; 0 = off
    tf32: bool = False             # CuPy: float32 matrix products may use TF32 matrix units; ignored on NumPy


@dataclass(frozen=True)
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Return the configuration as plain nested dicts (JSON/TOML friendly), without the other kind's model keys."""
        out = dataclasses.asdict(self)
        mine = KIND_KEYS.get(self.model.kind, ())
        for key in {k for keys in KIND_KEYS.values() for k in keys} - set(mine):
            del out["model"][key]
        return out

    @property
    def n_layers(self) -> int:
        """Number of layers (MLP: Linear layers; GPT and llama: layer groups, n_blocks + 2)."""
        if self.model.kind in DECODERS:
            return self.model.n_blocks + 2
        return len(self.model.dims) - 1

    def layers_text(self) -> str:
        """Name the layers for a message: 'model.dims [..]' or 'the GPT's n_blocks + 2 layer groups'."""
        if self.model.kind in DECODERS:
            name = "GPT" if self.model.kind == "gpt" else "model"
            return f"the {name}'s layer groups (model.n_blocks {self.model.n_blocks} + 2)"
        return f"model.dims {self.model.dims}"


def _check_type(where: str, value: Any, hint: Any) -> Any:
    """Return value converted to the field's type, or raise ConfigError naming both."""
    text = hint.__name__ if isinstance(hint, type) else f"{hint}".replace("typing.", "")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:   # an integer beyond float range
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"{where} must be a finite number, got {value!r}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    elif text == "int | str":
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return value
    elif text == "dict":
        if isinstance(value, dict) and all(isinstance(k, str) for k in value) and all(
                isinstance(v, (str, int, float, bool)) for v in value.values()):
            return dict(value)
        raise ConfigError(f"{where} must be a table of keys and plain values, got {value!r}")
    elif text == "list[str]":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    elif text in ("list[int]", "list[int] | str"):
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
        if text.endswith("str") and isinstance(value, str):
            return value
    else:  # pragma: no cover - a new field type without a checker is a programming error
        raise TypeError(f"no type check for {where}: {text}")
    wanted, hint = UNION_WORDS.get(text, text), toml_hint(where, text, value)
    raise ConfigError(f"{where} must be {wanted}, got {value!r} ({type(value).__name__}){hint}")


def _build(section_cls: type, name: str, values: dict[str, Any]) -> Any:
    """Build one section dataclass from a dict, refusing unknown keys and wrong types."""
    hints = get_type_hints(section_cls)
    known = {f.name for f in fields(section_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]}{_did_you_mean(name, unknown[0])} "
                          f"(known keys in [{name}]: {', '.join(sorted(known))})")
    kwargs = {key: _check_type(f"{name}.{key}", value, hints[key]) for key, value in values.items()}
    return section_cls(**kwargs)


def _did_you_mean(section: str, key: str) -> str:
    """': did you mean section.key?' for the known key closest to a misspelled one (this section first), or ''."""
    hints = get_type_hints(Config)
    mine = [f.name for f in fields(hints[section])]
    close = difflib.get_close_matches(key.lower(), mine, n=1)     # STEPS: steps
    if close:
        return f": did you mean {section}.{close[0]}?"
    # a key of another section ([model] steps = 5): the same name, or one close to it, there
    others = {f"{name}.{f.name}": f.name for name in hints for f in fields(hints[name]) if name != section}
    close = difflib.get_close_matches(key, list(others.values()), n=1, cutoff=0.8)
    found = [full for full, short in others.items() if close and short == close[0]]
    return f": did you mean {found[0]}?" if found else ""


def _parse_value(text: str) -> Any:
    """Parse a --set value as a TOML value; bare words that are not TOML become strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override(item: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into its parts, parsing value as TOML."""
    if "=" not in item:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set key must be section.key, got {key.strip()!r}")
    return parts[0], parts[1], _parse_value(text.strip())


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML file (or the embedded default when path is None), apply overrides, validate."""
    return from_dict(load_raw(path, overrides))


def load_raw(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Return the nested dicts a TOML file and ``--set`` overrides give, before defaults and validation.

    Front ends that fill unset keys from elsewhere (``infer`` takes the model
    from the weights) use this to know which keys the user actually set.
    """
    raw: dict[str, dict[str, Any]] = {}
    if path:
        raw = _read_toml(Path(path))
    for item in overrides:
        section, key, value = parse_override(item)
        section_values = raw.setdefault(section, {})
        if not isinstance(section_values, dict):
            raise ConfigError(f"[{section}] must be a table of keys, got {section_values!r}")
        section_values[key] = value
    return raw


MAX_CONFIG_BYTES = 1 << 20


def _read_toml(p: Path) -> dict[str, Any]:
    """Return a config file's tables, or raise ConfigError saying what is wrong with the file."""
    label = f"config file {str(p)!r}"
    if p.is_dir():
        raise ConfigError(f"{label} is a directory, not a TOML file")
    if not p.exists():
        from hpcpipe.h5files import broken_symlink  # h5py is imported only on this error path
        raise ConfigError(f"{label} {broken_symlink(p) or 'does not exist'}")
    if not p.is_file():      # a FIFO would block start-up forever, /dev/zero would fill the memory
        raise ConfigError(f"{label} is not a regular file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{label} holds {p.stat().st_size} bytes; a config file is at most {MAX_CONFIG_BYTES}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label} is not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                          f"TOML files must be UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{label} cannot be read: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label} is not valid TOML: {exc}") from None


def from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested dicts as read from TOML."""
    sections = {f.name: f for f in fields(Config)}
    hints = get_type_hints(Config)
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise unknown_section(unknown[0], raw[unknown[0]], {n: [f.name for f in fields(hints[n])] for n in sections})
    model, train = raw.get("model"), raw.get("train", {})
    if isinstance(model, dict) and model.get("kind") in DECODERS and isinstance(train, dict):
        # a GPT's loss is token cross-entropy: the default, so that a saved config reads back
        raw = {**raw, "train": {"loss": "cross_entropy", **train}}
    built = {}
    for name, value in raw.items():
        if not isinstance(value, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {value!r}")
        built[name] = _build(hints[name], name, value)
    _check_kind_keys(raw)
    config = Config(**built)
    validate(config)
    return config


def _check_kind_keys(raw: dict[str, Any]) -> None:
    """Refuse model keys of the other model kind, and a loss other than token cross-entropy for a GPT."""
    model = raw.get("model", {})
    kind = model.get("kind", "mlp")
    if kind not in KINDS:
        raise ConfigError(f"model.kind {kind!r} is not one of {', '.join(KINDS)}")
    foreign = [k for k in model if k not in KIND_KEYS[kind] and any(k in keys for keys in KIND_KEYS.values())]
    if foreign:
        owners = [KIND_NAMES[other] for other, keys in KIND_KEYS.items() if foreign[0] in keys]
        raise ConfigError(f"model.{foreign[0]} is a key of {' or '.join(owners)} and cannot be set with "
                          f"model.kind = {kind!r} (keys set: {', '.join('model.' + k for k in foreign)})")
    loss = raw.get("train", {}).get("loss")
    if kind in DECODERS and loss not in (None, "cross_entropy"):
        raise ConfigError(f"train.loss = {loss!r}: {KIND_NAMES[kind]} (model.kind = \"{kind}\") trains on "
                          f"cross-entropy over tokens; leave train.loss unset or set it to \"cross_entropy\"")


def resolve_layout(config: Config, world_size: int) -> tuple[int, int]:
    """Return (dp, pp) for this world size (dp x pp x parallel.tp ranks), or raise ConfigError naming the mismatch."""
    pp, dp, tp = config.parallel.pp, config.parallel.dp, config.parallel.tp
    if world_size % tp:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.tp ({tp}): dp x pp x tp must equal "
                          f"the world size")
    grid = world_size // tp       # the (dp, pp) cells; each holds tp ranks
    if tp > 1 and pp != "auto" and dp != "auto" and dp * pp * tp != world_size:
        raise ConfigError(f"world size {world_size} does not equal parallel.dp ({dp}) x parallel.pp ({pp}) x "
                          f"parallel.tp ({tp}) = {dp * pp * tp}")
    cells = f"world size {world_size}" if tp == 1 else f"world size {world_size} / parallel.tp ({tp}) = {grid}"
    if pp == "auto":
        if grid % dp:
            raise ConfigError(f"{cells} is not divisible by parallel.dp ({dp})")
        pp = grid // dp
    if dp == "auto":
        if grid % pp:
            raise ConfigError(f"{cells} is not divisible by parallel.pp ({pp}): run on a multiple "
                              f"of {pp * tp} ranks, or set parallel.pp to a divisor of {grid} (e.g. "
                              f"--set parallel.pp=1)")
        dp = grid // pp
    if dp * pp != grid:
        raise ConfigError(f"{cells} does not equal parallel.dp ({dp}) x parallel.pp ({pp}) = {dp * pp}")
    ep = config.parallel.ep
    if dp % ep:
        raise ConfigError(f"parallel.ep ({ep}) does not divide parallel.dp ({dp}): the experts are split over ep "
                          f"consecutive data-parallel replicas of a stage (world size {world_size} = dp x pp x tp)")
    vs = config.parallel.virtual_stages
    if pp * vs > config.n_layers:
        raise ConfigError(f"parallel.pp ({pp}) x parallel.virtual_stages ({vs}) exceeds the number of layers "
                          f"({config.n_layers}) in {config.layers_text()}")
    if isinstance(config.parallel.stage_layers, list) and config.parallel.stage_layers \
            and len(config.parallel.stage_layers) != pp * vs:
        raise ConfigError(f"parallel.stage_layers has {len(config.parallel.stage_layers)} entries but the "
                          f"pipeline has pp ({pp}) x virtual_stages ({vs}) = {pp * vs} stages")
    return dp, pp
