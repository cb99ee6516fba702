"""What ``checkpoint info`` says about LoRA: a PEFT adapter directory, and a LoRA run's checkpoint's adapters."""

from __future__ import annotations

from pathlib import Path

from hpcpipe.errors import ConfigError
from hpcpipe.state.adapters import lora_settings
from hpcpipe.state.peft import read_adapter


def describe_adapter(path: Path) -> list[str]:
    """Lines about a PEFT adapter directory: its rank, alpha, targets and base, and how to use it."""
    adapter = read_adapter(path, "PEFT adapter directory")
    s = adapter.settings
    return [f"PEFT adapter directory {str(path)!r} (LoRA adapters, not a model nor a checkpoint): r = {s.rank}, "
            f"lora_alpha = {s.alpha:g}{' (rsLoRA)' if s.rslora else ''}, targets {', '.join(s.targets)}; "
            f"{len(adapter.shapes)} tensors",
            f"  base model {adapter.base_name!r}" if adapter.base_name else "  base model not recorded",
            "  use it on its base: generate/serve --weights BASE --adapter DIR (or model.adapter = DIR); train "
            "model.adapter = DIR to train it further"]


def lora_lines(config: dict) -> list[str]:
    """["  LoRA r = 8, lora_alpha = 16, targets q_proj, v_proj ..."] for a LoRA run's saved config, else []."""
    try:
        settings = lora_settings(config)
    except (ConfigError, KeyError, TypeError) as exc:     # info describes even a damaged checkpoint
        return [f"  LoRA settings unreadable: {exc}"]
    if settings is None:
        return []
    return [f"  LoRA adapters r = {settings.rank}, lora_alpha = {settings.alpha:g}, targets "
            f"{', '.join(settings.targets)} (beside the frozen base; it reads as its merged model)"]
