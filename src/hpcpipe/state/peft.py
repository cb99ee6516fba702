"""PEFT LoRA adapter directories, in and out: ``adapter_config.json`` and ``adapter_model.safetensors``.

What ``peft.PeftModel.from_pretrained(base, DIR)`` loads and ``PeftModel.save_pretrained`` writes, for the
LoRA hpcpipe computes (:mod:`hpcpipe.nn.lora`): peft_type LORA, r, lora_alpha, target_modules (a list),
use_rslora; the tensors ``base_model.model.<the kind's prefix><module>.lora_A.weight`` (r, in) and
``.lora_B.weight`` (out, r), transposes of hpcpipe's A (in, r) and B (r, out), named through the kind's
Hugging Face map. Anything PEFT would compute otherwise (DoRA, biases, modules_to_save, per-layer ranks or
alphas, layers_to_transform) is refused in one line naming the file and the key, never silently dropped.
An adapter whose tensors do not fit the model (another base: other widths, more layers, other modules) is
refused naming the tensor and both shapes.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.hf.config import ADAPTER_CONFIG, read_json_file
from hpcpipe.hf.safetensors import SafetensorsFile, write_safetensors
from hpcpipe.nn.lora import LoraSettings, block_maps, no_lora, peft_names
from hpcpipe.nn.registry import KINDS
from hpcpipe.state import directory_protocol as cf

CONFIG = ADAPTER_CONFIG
WEIGHTS = "adapter_model.safetensors"
# keys whose other values PEFT computes differently from hpcpipe's LoRA: refused
FIXED = {"use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
         "alpha_pattern": {}, "layers_to_transform": None, "layer_replication": None, "target_parameters": None,
         "trainable_token_indices": None, "use_qalora": False, "exclude_modules": None}


@dataclass(frozen=True)
class PeftAdapter:
    """A checked PEFT LoRA directory: its settings and the tensors (name -> stored shape) of its safetensors."""

    path: Path
    settings: LoraSettings
    base_name: str | None
    shapes: dict[str, tuple[int, ...]]

    def describe(self) -> str:
        """A label for messages."""
        return f"PEFT adapter {str(self.path)!r}"


def read_adapter(directory: str | Path, label: str = "model.adapter") -> PeftAdapter:
    """Read and check a PEFT directory's config and safetensors header; ConfigError (one line) naming what is wrong."""
    path = Path(directory)
    where = f"{label} {str(directory)!r}"
    if not path.is_dir():
        raise ConfigError(f"{where} {'is not a directory' if path.exists() else 'does not exist'} (a PEFT adapter is "
                          f"a directory with {CONFIG} and {WEIGHTS})")
    if not os.path.lexists(path / CONFIG) and os.path.lexists(path / "config.json"):   # a model, not its adapter
        raise ConfigError(f"{where} is a model directory (config.json), not a PEFT adapter (a directory with {CONFIG} "
                          f"and {WEIGHTS}): give the model as model.init (train) or --weights (generate, serve)")
    config = read_json_file(path / CONFIG, f"{label}'s config")
    file = path / CONFIG
    if not isinstance(config, dict):
        raise ConfigError(f"{str(file)!r} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{str(file)!r}: peft_type {config.get('peft_type')!r} is not supported (hpcpipe reads LORA "
                          f"adapters)")
    for key, fine in FIXED.items():
        value = config.get(key, fine)
        if value != fine and value not in (None, {}, [], False):      # absent, null or empty: PEFT's default
            raise ConfigError(f"{str(file)!r}: {key} = {json.dumps(value)} is not supported (hpcpipe's LoRA needs "
                              f"{json.dumps(fine)})")
    rank, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{str(file)!r}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"{str(file)!r}: lora_alpha must be a positive number, got {alpha!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{str(file)!r}: target_modules must be a list of module names, got {json.dumps(targets)} "
                          f"(a regular expression is not supported: list the modules)")
    if not (path / WEIGHTS).is_file():
        other = [p.name for p in path.glob("adapter_model*")]
        raise ConfigError(f"{where} has no {WEIGHTS}" + (f" (it has {other}: hpcpipe reads safetensors only)"
                                                          if other else ""))
    header = SafetensorsFile(path / WEIGHTS).tensors
    settings = LoraSettings(rank, float(alpha), tuple(sorted(targets)), bool(config.get("use_rslora", False)))
    return PeftAdapter(path, settings, config.get("base_model_name_or_path"),
                       {name: tuple(info.shape) for name, info in header.items()})


def expected_tensors(settings: LoraSettings, kind: str, keys: dict[str, Any], specs: list[Any]
                     ) -> dict[str, tuple[int, str, tuple[int, ...]]]:
    """{PEFT tensor name: (layer group, hpcpipe name, PEFT shape)} of every adapter of the model."""
    hf = KINDS[kind].hf
    out = {}
    for i in range(1, keys["n_blocks"] + 1):
        for name, peft in peft_names(hf, keys, i, settings.targets).items():
            n_in, n_out = specs[i].shapes[name.rsplit("/", 1)[0] + "/weight"]
            out[peft] = (i, name, (settings.rank, n_in) if name.endswith("lora_a") else (n_out, settings.rank))
    return out


def check_targets(adapter: PeftAdapter, kind: str, keys: dict[str, Any]) -> None:
    """Raise ConfigError unless the model's kind has every module the adapter targets."""
    hf = KINDS[kind].hf
    if hf is None or not hf.lora_targets:
        raise ConfigError(f"{adapter.describe()}: {no_lora(hf, kind)}")
    modules = block_maps(hf, keys, kind)
    unknown = [t for t in adapter.settings.targets if t not in modules]
    if unknown:
        raise ConfigError(f"{adapter.describe()} targets {unknown[0]!r}, which model.kind = \"{kind}\" does not have "
                          f"(its modules: {', '.join(modules)}): it was made for another base model")


def check_adapter(adapter: PeftAdapter, kind: str, keys: dict[str, Any], specs: list[Any]) -> None:
    """Raise ConfigError unless the adapter's tensors are exactly the model's adapters, each of its shape."""
    check_targets(adapter, kind, keys)
    want = expected_tensors(adapter.settings, kind, keys, specs)
    for name, shape in adapter.shapes.items():
        if name not in want:
            deeper = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
            if deeper and int(deeper.group(1)) >= keys["n_blocks"]:
                raise ConfigError(f"{adapter.describe()} holds {name!r}, a block this model does not have (it has "
                                  f"{keys['n_blocks']} blocks): it was made for another base model")
            raise ConfigError(f"{adapter.describe()} holds {name!r}, which this model (model.kind = \"{kind}\") has no "
                              f"place for: it was made for another base model")
        if shape != want[name][2]:
            raise ConfigError(f"{adapter.describe()}: {name} has shape {shape}, this model's needs {want[name][2]} "
                              f"(r = {adapter.settings.rank}): it was made for another base model")
    missing = sorted(set(want) - set(adapter.shapes))
    if missing:
        raise ConfigError(f"{adapter.describe()} lacks {missing[0]} ({len(missing)} adapter tensors of its "
                          f"target_modules missing)")


def read_arrays(adapter: PeftAdapter, kind: str, keys: dict[str, Any], specs: list[Any], indices: list[int],
                dtype: str) -> dict[int, dict[str, np.ndarray]]:
    """The adapters of the given layer groups as hpcpipe arrays ({group: {prefix/lora_a: (in, r), ...}})."""
    file = SafetensorsFile(adapter.path / WEIGHTS)
    out: dict[int, dict[str, np.ndarray]] = {i: {} for i in indices}
    for peft, (i, name, _) in expected_tensors(adapter.settings, kind, keys, specs).items():
        if i in out:
            out[i][name] = file.read(peft, dtype, transpose=True)
    return out


def write_adapter(out: str | Path, arrays: dict[int, dict[str, np.ndarray]], settings: LoraSettings, kind: str,
                  keys: dict[str, Any], base_name: str | None = None, dtype: str = "float32") -> None:
    """Write the adapters of every block as a new PEFT directory at ``out`` (built under a temporary name), its
    tensors in ``dtype``."""
    hf = KINDS[kind].hf
    tensors = {}
    for i, group in arrays.items():
        for name, peft in peft_names(hf, keys, i, settings.targets).items():
            tensors[peft] = np.ascontiguousarray(np.asarray(group[name]).T)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
              "target_modules": list(settings.targets), "lora_dropout": 0.0, "bias": "none",
              "use_rslora": settings.rslora, "use_dora": False, "fan_in_fan_out": kind == "gpt",
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base_name, "rank_pattern": {}, "alpha_pattern": {},
              "layers_to_transform": None, "layers_pattern": None, "revision": None}
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        write_safetensors(tmp / WEIGHTS, tensors, dtype=dtype)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            cf.fsync_path(path)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def restate_adapter(raw: dict[str, Any]) -> dict[str, Any]:
    """Raw config sections with train.lora_rank, lora_alpha and lora_targets taken from model.adapter's config
    (the configuration may restate them, not contradict them); raw itself without model.adapter."""
    adapter = raw.get("model", {}).get("adapter") if isinstance(raw.get("model"), dict) else None
    if not isinstance(adapter, str) or not adapter:
        return raw
    found = read_adapter(adapter)
    settings = found.settings
    model = from_dict({"model": raw["model"], "parallel": {"pp": 1}}).to_dict()["model"]
    check_targets(found, model["kind"], model)
    raw = {name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()}
    train = raw.setdefault("train", {})
    if not isinstance(train, dict):
        return raw
    for key, value in (("lora_rank", settings.rank), ("lora_alpha", settings.alpha),
                       ("lora_targets", list(settings.targets))):
        given = train.get(key)
        same = given == value or (key == "lora_targets" and isinstance(given, list) and sorted(given) == value)
        if given is not None and not same:
            raise ConfigError(f"train.{key} = {json.dumps(given)} does not match model.adapter {adapter!r}, which was "
                              f"made with {json.dumps(value)} ({CONFIG})")
        train[key] = value
    if settings.rslora:
        raise ConfigError(f"model.adapter {adapter!r} uses rsLoRA (use_rslora = true): training one further is not "
                          f"supported; serve it with --adapter")
    return raw
