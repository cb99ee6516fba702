"""LoRA adapters on stored weights: the merged view forward-only readers see, and the adapters a run starts from.

A checkpoint of a LoRA run (its config's train.lora_rank) holds the frozen base and the adapters in the same
layer groups (``attn/q/weight`` beside ``attn/q/lora_a``, ``attn/q/lora_b``). What ``generate``, ``serve``,
``evaluate`` and ``export --merge-adapter`` read of it is the fine-tuned model, :class:`MergedSource`::

    W' = W + s A @ B        (s = lora_alpha / r; hpcpipe.nn.lora)

per tensor-parallel part: the part of W a rank reads (columns or rows, its ``shards``) gets the matching
part of the product (B's columns or A's rows). ``generate``/``serve --adapter DIR`` merge a PEFT directory
(:mod:`hpcpipe.state.peft`) into any base (a Hugging Face model, a weights file, a checkpoint) the same way.
Nothing is written: the view merges on every read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.nn.lora import LoraSettings, block_maps
from hpcpipe.nn.registry import KINDS, model_specs
from hpcpipe.state.hf_convert import check_range
from hpcpipe.state.peft import check_adapter, check_targets, read_adapter, read_arrays, write_adapter
from hpcpipe.state.weights_source import Shards, WeightsSource

Adapters = Callable[[list[int]], dict[int, dict[str, np.ndarray]]]


def lora_settings(config: dict[str, Any]) -> LoraSettings | None:
    """The adapters a saved config (a checkpoint manifest's) trained, None for a run without LoRA."""
    train = config.get("train", {})
    if not train.get("lora_rank"):
        return None
    keys = ("lora_rank", "lora_alpha", "lora_targets")
    built = from_dict({"model": config["model"], "parallel": {"pp": 1},
                       "train": {key: train[key] for key in keys if key in train}})
    kind = built.model.kind
    targets = tuple(built.train.lora_targets) or KINDS[kind].hf.lora_targets
    return LoraSettings(built.train.lora_rank, built.train.lora_alpha, targets)


def prefixes(settings: LoraSettings, kind: str, keys: dict[str, Any]) -> list[str]:
    """The hpcpipe prefixes of the maps a block's adapters sit on (``attn/q``, ...)."""
    maps = block_maps(KINDS[kind].hf, keys, kind)
    return [prefix for module in settings.targets for prefix in maps[module]]


def merge(arrays: dict[str, Any], adapters: dict[str, Any], names: list[str], scaling: float,
          parts: dict[str, Any] | None) -> None:
    """W += s A @ B in place for each prefix in names, on the part of W ``parts`` (its Shard) names."""
    for prefix in names:
        w = arrays[f"{prefix}/weight"]
        a, b = adapters[f"{prefix}/lora_a"], adapters[f"{prefix}/lora_b"]
        shard = (parts or {}).get(f"{prefix}/weight")
        if shard is not None and shard.axis == 1:
            b = b[:, shard.index]
        elif shard is not None and shard.axis == 0:
            a = a[shard.index]
        merged = np.asarray(w, dtype=np.float64) + (np.asarray(a, np.float64) @ np.asarray(b, np.float64)) * scaling
        arrays[f"{prefix}/weight"] = merged.astype(np.asarray(w).dtype)


@dataclass(frozen=True)
class MergedSource:
    """A source whose targeted matrices read as W + s A @ B: a LoRA checkpoint (``adapters`` None: they sit in its
    own groups) or any base with a PEFT directory's adapters (``adapters(indices)``)."""

    base: WeightsSource
    settings: LoraSettings
    names: tuple[str, ...]                 # prefixes of the adapted maps in every block
    n_blocks: int
    adapters: Adapters | None = None
    label: str = ""

    def __getattr__(self, name: str) -> Any:
        # path, kind, step, n_layers, model, model_kind, tokenizer, read_optimizer: the base's
        return getattr(self.base, name)

    def describe(self) -> str:
        """The base's label, with the adapter's."""
        return self.base.describe() + (f" with {self.label}" if self.label else " (LoRA adapters merged)")

    def check(self, specs: list[Any], key: str = "") -> None:
        """The base's check of the merged model's specs (a LoRA checkpoint's adapters checked by its manifest)."""
        if self.adapters is not None:
            self.base.check(specs, key)
            return
        stored = getattr(self.base, "specs", None) or []
        mine = [{name: shape for name, shape in s.shapes.items() if name not in _adapter_names(s)} for s in stored]
        if [dict(s.shapes) for s in specs] != mine:
            self.base.check(specs, key)       # says what differs (it holds adapters besides)
        self.base.check(stored, key)

    def read(self, indices: list[int], shards: Shards | None = None) -> dict[int, dict[str, Any]]:
        """The base's groups, the adapted matrices merged (each rank its tensor-parallel part)."""
        arrays = self.base.read(indices, shards)
        extra = self.adapters(indices) if self.adapters is not None else None
        for i in indices:
            if not 1 <= i <= self.n_blocks:
                continue
            group = arrays[i]
            held = extra[i] if extra is not None else {n: group.pop(n) for n in list(group) if _is_adapter(n)}
            merge(group, held, list(self.names), self.settings.scaling,
                  shards(i, list(group)) if shards is not None else None)
        return arrays

    def matrix_itemsize(self) -> int:
        """4: the merged matrices are float sums (see forward_only)."""
        return 4

    def forward_only(self, dtype: str, half_embedding: bool = False, stored: bool = False,
                     quantize: bool = False) -> MergedSource:
        """The merged view of the base's forward-only source (matrices as float arrays: they are sums, which the
        stage then keeps in its weight format, q8_0 included); a LoRA checkpoint's view itself (its base reads
        float32 as stored, and its own forward_only is this view)."""
        if self.adapters is None:
            return self
        return replace(self, base=self.base.forward_only(dtype, half_embedding, False, False))


def _is_adapter(name: str) -> bool:
    return name.endswith(("/lora_a", "/lora_b"))


def _adapter_names(spec: Any) -> set[str]:
    return {name for name in spec.shapes if _is_adapter(name)}


def merged_if_adapted(source: Any) -> Any:
    """A checkpoint of a LoRA run as forward-only readers see it (merged); any other source as it is."""
    manifest = getattr(source, "manifest", None)
    settings = lora_settings(manifest["config"]) if manifest else None
    if settings is None:
        return source
    keys = manifest["config"]["model"]
    kind = keys.get("kind", "mlp")
    full = from_dict({"model": keys, "parallel": {"pp": 1}}).to_dict()["model"]
    return MergedSource(source, settings, tuple(prefixes(settings, kind, full)), full["n_blocks"])


def with_peft(source: WeightsSource, directory: str | Path, config: Any, label: str = "--adapter") -> MergedSource:
    """A base source with a PEFT directory's adapters merged; ConfigError when the adapter does not fit the model."""
    if isinstance(source, MergedSource) and source.adapters is None:
        raise ConfigError(f"{label}: {source.base.describe()} was trained with LoRA and already includes its "
                          f"adapters (it reads as its merged model); {label} is for a base model")
    adapter = read_adapter(directory, label)
    kind, keys = config.model.kind, config.to_dict()["model"]
    check_targets(adapter, kind, keys)
    lora = from_dict({**config.to_dict(), "train": {"lora_rank": adapter.settings.rank,
                                                    "lora_targets": list(adapter.settings.targets)}})
    specs = model_specs(lora)
    check_adapter(adapter, kind, keys, specs)

    def adapters(indices: list[int]) -> dict[int, dict[str, np.ndarray]]:
        return read_arrays(adapter, kind, keys, specs, indices, "float64")

    return MergedSource(source, adapter.settings, tuple(prefixes(adapter.settings, kind, keys)), keys["n_blocks"],
                        adapters, adapter.describe())


def check_whole(source: WeightsSource) -> None:
    """Raise UsageError when the source is one stage's file of a checkpoint (or another file of some layers only):
    an export needs the whole model, which the step directory holds."""
    if hasattr(source, "require_whole"):
        source.require_whole("export")


def exported_source(source: WeightsSource, merge: bool) -> WeightsSource:
    """What ``checkpoint export`` writes of a source: a LoRA run's checkpoint only merged (``--merge-adapter``);
    ConfigError (a usage error) when merge does not fit the source."""
    check_whole(source)
    merged = merged_if_adapted(source)
    if merged is source:
        if merge:
            raise ConfigError(f"{source.describe()} holds no LoRA adapters (its run had train.lora_rank = 0): "
                              f"--merge-adapter has nothing to merge")
        return source
    if not merge:
        raise ConfigError(f"{source.describe()} holds LoRA adapters (train.lora_rank = {merged.settings.rank}) beside "
                          f"its frozen base: export --format peft writes the adapters as a PEFT directory, "
                          f"--merge-adapter the merged model")
    return merged


def check_peft_exportable(source: WeightsSource) -> None:
    """Raise ConfigError unless the source is a LoRA run's checkpoint (it has adapters to write)."""
    check_whole(source)
    if merged_if_adapted(source) is source:
        raise ConfigError(f"{source.describe()} holds no LoRA adapters (its run had train.lora_rank = 0): "
                          f"export --format peft writes a LoRA run's adapters")


def _base_directory(init: str, step_dir: Path, ck_dir: str) -> str | None:
    """The absolute path of the Hugging Face directory a run tuned (model.init), or None: a relative model.init is
    found from here or from the directory the run started in (its relative checkpoint.dir leads back to it)."""
    if not init:
        return None
    starts = [Path.cwd()]
    ck = Path(ck_dir) if ck_dir else None
    root = Path(os.path.abspath(step_dir.parent))
    if ck is not None and ck.parts and not ck.is_absolute() and ".." not in ck.parts:
        for top in (root, root.parent):              # the root, or the root above a run directory
            if top.parts[-len(ck.parts):] == ck.parts:
                starts.append(top.parents[len(ck.parts) - 1])
    for start in starts:
        path = start / init
        if (path / "config.json").is_file():
            return os.path.abspath(path)
    return None


def export_peft(source: WeightsSource, out: str | Path, dtype: str = "float32") -> LoraSettings:
    """Write a LoRA run's checkpoint's adapters as a new PEFT directory in ``dtype`` (one block in memory at a time);
    its base_model_name_or_path is the absolute path of the run's model.init when that is a Hugging Face directory
    here (what ``peft.AutoPeftModelForCausalLM`` loads from anywhere)."""
    check_peft_exportable(source)
    merged = merged_if_adapted(source)
    config = source.manifest["config"]
    keys = from_dict({"model": config["model"], "parallel": {"pp": 1}}).to_dict()["model"]
    adapters = {}
    for i in range(1, merged.n_blocks + 1):
        group = source.read([i])[i]
        adapters[i] = {name: array for name, array in group.items() if _is_adapter(name)}
    base = _base_directory(keys.get("init") or "", Path(source.path), config.get("checkpoint", {}).get("dir", ""))
    check_range({f"layer {i} {name}": a for i, group in adapters.items() for name, a in group.items()}, dtype,
                source.describe())                     # a value --dtype cannot hold: refused, nothing written
    write_adapter(out, adapters, merged.settings, keys["kind"], keys, base, dtype)
    return merged.settings
