"""Planning an inference run on every rank with no collective: model from the weights, layout, input and output paths.

The model (dims, bias, activation, final_activation, dtype) is the one
stored with the weights; ``--config``/``--set`` may restate it but not
contradict it. Any (dp, pp) layout reads weights saved at any layout. No
output, trace or report may be the input, the weights or lie inside the
checkpoint the weights come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcpipe.config import DECODERS, Config, from_dict, load_raw, resolve_layout
from hpcpipe.errors import ConfigError
from hpcpipe.infer.memory import check_memory
from hpcpipe.infer.rows import (
    check_input,
    check_output,
)
from hpcpipe.nn.partition import partition
from hpcpipe.nn.registry import model_specs
from hpcpipe.profiles.stage_cut import stage_counts
from hpcpipe.state.kinds import restate_stored_model
from hpcpipe.state.sources import protected_paths, resolve_weights
from hpcpipe.state.weights_source import WeightsSource

# model keys the weights decide; the config may repeat them but not contradict them
MODEL_KEYS = ("dims", "bias", "activation", "final_activation", "dtype")


@dataclass(frozen=True)
class InferSetup:
    """Everything decided before the first collective (identical on every rank)."""

    config: Config
    dp: int
    pp: int
    stage_ranges: list[range]
    weights: WeightsSource
    input: str
    output: str
    n_rows: int
    trace: str = ""      # Chrome-trace file to write ("" = none)


def refuse_decoder(source: WeightsSource, given: str | Path) -> None:
    """Raise ConfigError when the weights hold a language model: batch inference runs MLPs; text is generate/serve."""
    kind = source.model_kind
    if kind in DECODERS:
        name = "a GPT" if kind == "gpt" else "a Llama-family"
        raise ConfigError(f'--weights {str(given)!r} holds {name} model (model.kind = "{kind}", {source.n_layers} '
                          f"layer groups): batch inference (python -m hpcpipe.infer) covers MLP models; text "
                          f"generation is python -m hpcpipe.generate (one prompt) or python -m hpcpipe.serve (HTTP)")


def model_from_weights(raw: dict[str, Any], stored: dict[str, Any], label: str) -> dict[str, Any]:
    """Return raw config sections with the model keys taken from the weights; ConfigError on a contradiction."""
    model = raw.get("model", {})
    kind = stored.get("kind", "mlp")
    if isinstance(model, dict) and "kind" in model and model["kind"] != kind:
        raise ConfigError(f"model.kind = {model['kind']!r} in the configuration does not match {label}, which holds "
                          f"model.kind = {kind!r} (batch inference covers MLP models)")
    return restate_stored_model(raw, stored, label, MODEL_KEYS)


def prepare(weights: str | Path, input: str | Path, output: str | Path, world_size: int,
         config: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = (),
         trace: str = "", report: str = "") -> InferSetup:
    """Check weights, config, layout, input, output, trace and report paths locally; ConfigError names what is wrong.

    Nothing the run writes (output, trace, report) may be the input, the
    weights file, or lie inside the checkpoint the weights come from (the
    directory given as --weights, the one holding a given ``latest`` file,
    and the resolved step directory).
    """
    source = resolve_weights(weights, "--weights")
    refuse_decoder(source, weights)
    raw = load_raw(None, overrides) if isinstance(config, dict) or config is None else load_raw(config, overrides)
    if isinstance(config, dict):
        base = {name: dict(values) for name, values in config.items()}
        for name, values in raw.items():
            base.setdefault(name, {}).update(values)
        raw = base
    cfg = from_dict(model_from_weights(raw, source.model, source.describe()))
    if cfg.parallel.virtual_stages != 1:
        raise ConfigError(f"inference runs one stage per rank: parallel.virtual_stages must be 1, got "
                          f"{cfg.parallel.virtual_stages}")
    if cfg.parallel.tp != 1:    # the layout counted tp's ranks, the grid did not: "... x tp (1) = 1", an abort
        raise ConfigError(f"batch inference runs dp x pp ranks without tensor parallelism: parallel.tp must be 1, got "
                          f"{cfg.parallel.tp} (parallel.tp is for train, generate and serve)")
    dp, pp = resolve_layout(cfg, world_size)
    specs = model_specs(cfg)
    ranges = partition(specs, pp, stage_counts(cfg, pp, cfg.infer.micro_batch_size, ("F",)))
    source.check(specs, "--weights")
    n_rows = check_input(input, cfg.infer.x, cfg.model.dims[0])
    files, dirs = protected_paths(weights, source)
    check_output(output, input, files, dirs)
    trace = trace or cfg.log.trace
    written = ((f"the output file {str(output)!r}", Path(output)),)
    if trace:
        check_output(trace, input, files + written, dirs, "trace path", "trace")
        written += ((f"the trace file {str(trace)!r}", Path(trace)),)
    if report:
        check_output(report, input, files + written, dirs, "report path", "report")
    check_memory(cfg, ranges, n_rows, world_size)   # e.g. infer.buffers = 1e8: refused before a byte is allocated
    return InferSetup(cfg, dp, pp, ranges, source, str(input), str(output), n_rows, trace)
