"""The configuration a resumed run continues under: the run's own saved config, the command line on top.

``--resume`` used to build its config from the embedded defaults and the command
line alone, so a run started with ``--config big.toml`` and resumed with a bare
``--resume`` went on silently under another layout and step count. Every
checkpoint's manifest holds the config its run saved with; when resuming, that
is the base, and the keys the command line gives (``--config`` file,
``--set``) replace its values. A layout given anew is taken whole: a new
``parallel.pp`` drops the saved ``dp`` and ``stage_layers`` (they were for the
old pipeline), a new ``virtual_stages`` the saved ``stage_layers``, another
``schedule`` the saved ``virtual_stages`` and ``stage_layers``, unless the
command line gives them too, so resharding with ``--set parallel.pp=2`` works
as before; a ``[model]`` of another kind (``model.kind``, or keys only another
kind reads) replaces the saved one, and the checkpoint is refused naming both
kinds. One line says which keys differ from the saved config.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, get_type_hints

from hpcpipe.config import KIND_KEYS, CheckpointConfig, Config, from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.state.sources import resolve_weights

# a parallel key given anew -> the saved keys that described the old pipeline with it
LAYOUT_DEPENDENTS = {"pp": ("dp", "stage_layers"), "virtual_stages": ("stage_layers",)}
# given with another value than the saved one: the saved virtual stages were the old schedule's (zb-v's 2 under 1f1b)
CHANGED_DEPENDENTS = {"schedule": ("virtual_stages", "stage_layers")}


def known_keys(saved: dict) -> dict[str, dict[str, Any]]:
    """The sections and keys of a saved config that this version knows (another version may have had others)."""
    hints = get_type_hints(Config)
    out: dict[str, dict[str, Any]] = {}
    for section, values in saved.items():
        if section in hints and isinstance(values, dict):
            names = {f.name for f in fields(hints[section])}
            out[section] = {k: v for k, v in values.items() if k in names}
    return out


NOTHING_TO_RESUME = ": nothing to resume (without --resume a fresh run starts there)"


def saved_config(raw: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], str] | None:
    """(the saved config, the checkpoint's path) of the checkpoint ``--resume`` continues, or None when checkpoint.dir
    is no checkpoint directory (prepare then says what is wrong, in its own order).

    A checkpoint.dir that cannot be read (missing, a broken ``latest``) is said here, first: the layout check would
    otherwise judge the command line's config alone and blame a layout the user never chose.
    """
    checkpoint = raw.get("checkpoint") if isinstance(raw.get("checkpoint"), dict) else {}
    directory = checkpoint.get("dir", CheckpointConfig.dir)
    if not isinstance(directory, str) or not directory:
        return None
    source = resolve_weights(directory, "checkpoint.dir", NOTHING_TO_RESUME)
    manifest = getattr(source, "manifest", None)
    if source.kind != "checkpoint" or not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
        return None
    return known_keys(manifest["config"]), str(source.path)


def merged(saved: dict[str, dict[str, Any]], raw: dict[str, Any]) -> dict[str, Any]:
    """The saved config with the command line's keys on top (a new layout or model kind replaces the old whole)."""
    out: dict[str, Any] = {section: dict(values) for section, values in saved.items()}
    for section, values in raw.items():
        if not isinstance(values, dict):     # from_dict names the mistake
            out[section] = values
            continue
        base = out.setdefault(section, {})
        if section == "parallel":
            changed = {k: v for k, v in CHANGED_DEPENDENTS.items() if k in values and values[k] != base.get(k)}
            for given, dependents in {**LAYOUT_DEPENDENTS, **changed}.items():
                if given in values:
                    for name in dependents:
                        if name not in values:
                            base.pop(name, None)
        if section == "model" and another_model(base, values):
            base.clear()     # the saved model's keys would hide the refusal that names the two kinds
        base.update(values)
    return out


def another_model(saved: dict[str, Any], given: dict[str, Any]) -> bool:
    """Whether the command line's [model] describes another kind than the saved one (by model.kind or its keys)."""
    kind = saved.get("kind", "mlp")
    if "kind" in given:
        return given["kind"] != kind
    mine = KIND_KEYS.get(kind, ())
    return any(key not in mine and any(key in keys for keys in KIND_KEYS.values()) for key in given)


def flat(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{'section.key': value} of a config's sections."""
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def differences(saved: dict[str, dict[str, Any]], config: Config) -> list[str]:
    """'key old -> new' for every key whose value in config differs from the saved config's (resume itself aside)."""
    try:
        before = flat(from_dict(saved).to_dict())
    except ConfigError:          # a config this version would not accept: compare what was written
        before = flat(saved)
    after = flat(config.to_dict())
    keys = [k for k in after if k != "checkpoint.resume" and k in before and before[k] != after[k]]
    return [f"{k} {before[k]!r} -> {after[k]!r}" for k in keys]


def resume_notice(where: str, changed: list[str]) -> str:
    """The one line a resumed run prints about its config."""
    if not changed:
        return f"hpcpipe: resuming {where!r} with its run's saved config (no key differs)"
    return f"hpcpipe: resuming {where!r} with its run's saved config, except {', '.join(changed)}"


def resumed(raw: dict[str, Any], notes: list[str] | None = None) -> Config:
    """The Config a run resumes with: the saved config under the command line's keys (``raw``); the line about it
    appended to ``notes``. Without a checkpoint to read, the command line's config as it is."""
    found = saved_config(raw)
    if found is None:
        return from_dict(raw)
    saved, where = found
    try:
        config = from_dict(merged(saved, raw))
    except ConfigError as exc:
        raise ConfigError(f"{exc} (resuming {where!r}: the keys not given on the command line are its run's "
                          f"saved config)") from None
    if notes is not None:
        notes.append(resume_notice(where, differences(saved, config)))
    return config
