"""What training decides before its first collective: every local check, the stage cut and the lowered schedule.

:func:`prepare` checks everything that can be checked locally, identically on
every rank, and raises ConfigError (one message, exit 2) before any rank
reaches a collective; the :class:`TrainSetup` it returns is what
:class:`hpcpipe.train.trainer.Trainer` builds communicators and runs steps from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.config import DECODERS, KIND_KEYS, Config, from_dict, load_raw, resolve_layout
from hpcpipe.errors import ConfigError, ScheduleError
from hpcpipe.nn.lora import base_specs
from hpcpipe.nn.optim import make_optimizer
from hpcpipe.nn.partition import partition
from hpcpipe.nn.registry import model_def
from hpcpipe.profiles.stage_cut import stage_counts
from hpcpipe.runtime.backend import check_backend
from hpcpipe.schedule.ir import PipeShape
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.registry import build_schedule, shape_of
from hpcpipe.schedule.validate_programs import validate_programs
from hpcpipe.state.adapters import merged_if_adapted
from hpcpipe.state.hdf5_source import HDF5Source
from hpcpipe.state.hf_source import is_hf_directory
from hpcpipe.state.kinds import check_kind, restate_stored_shape
from hpcpipe.state.peft import check_adapter, read_adapter, restate_adapter
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.tokenizer import StoredTokenizer
from hpcpipe.state.weights_source import WeightsSource
from hpcpipe.train.data import check_data_file, data_tokenizer
from hpcpipe.train.evaluation import check_eval_data
from hpcpipe.train.preflight import (
    check_checkpoint_dir,
    check_checkpoint_space,
    check_log_files,
    check_memory,
    check_nothing_newer,
)
from hpcpipe.train.resume_config import NOTHING_TO_RESUME, another_model, resumed, saved_config


@dataclass(frozen=True)
class TrainSetup:
    """Everything decided before the first collective."""

    config: Config
    dp: int
    shape: PipeShape                        # pp, stages, micro-batches and the schedule's stage -> rank placement
    stage_ranges: list[range]
    programs: list[list]
    init: WeightsSource | None = None      # model.init (a file, a checkpoint, a Hugging Face model), checked
    resume: HDF5Source | None = None       # checkpoint.dir/latest when resuming (always a checkpoint)

    tokenizer: StoredTokenizer | None = None   # a decoder's tokenizer: the data file's, else the weights'
    adapter: Any = None                    # model.adapter's PEFT directory (hpcpipe.state.peft), checked; fresh runs
    eval_rows: int = 0                     # data.eval_path's samples evaluated (whole global batches)
    samples: int = 0                       # the training set's size (data.path's rows, or synthetic_samples)

    @property
    def pp(self) -> int:
        """Pipeline ranks."""
        return self.shape.pp

    @property
    def n_stages(self) -> int:
        """Global (virtual) stages: pp x virtual stages."""
        return self.shape.n_stages


RESUME_MODEL_KEYS = {kind: ("kind", *keys, "dtype") for kind, keys in KIND_KEYS.items()}


def load_run_config(path: str | None, overrides: list[str] | tuple[str, ...] = (),
                    notes: list[str] | None = None) -> Config:
    """Return the run's Config: the TOML file and ``--set`` keys, and, when model.init names stored weights (a
    Hugging Face directory, an hpcpipe weights file or checkpoint), their model kind and shape (the config may
    restate them, not contradict them; an hpcpipe file's dtype is only the default).

    When resuming, the base is the run's own config saved in the checkpoint, the file's and ``--set``'s keys on
    top (:mod:`hpcpipe.train.resume_config`); the line saying what differs from it is appended to ``notes``.
    """
    raw = load_raw(path, overrides)
    model = raw.get("model")
    init = model.get("init") if isinstance(model, dict) else None
    resume = raw.get("checkpoint", {}).get("resume") if isinstance(raw.get("checkpoint"), dict) else None
    if resume is True and saved_config(raw) is not None:
        return resumed(raw, notes)
    # a fresh run, or --resume with nothing saved yet (a first job of a requeued chain): model.init's model decides
    if isinstance(init, str) and init:
        source, hf = resolve_weights(init, "model.init"), is_hf_directory(init)
        # a [model] of another kind than hpcpipe's stored one is left to prepare(), whose refusal names both kinds
        if hf or not another_model(source.model, model):
            raw = restate_stored_shape(raw, source, training=not hf)
    return from_dict(restate_adapter(raw))     # model.adapter: train.lora_* from its adapter_config.json


def check_resume(config: Config, source: HDF5Source) -> None:
    """Raise ConfigError unless the checkpoint can continue this run (same model and optimizer, step in range)."""
    saved = source.manifest["config"]
    for key in RESUME_MODEL_KEYS[config.model.kind]:
        stored = saved["model"].get(key, "mlp" if key == "kind" else None)   # older checkpoints: MLPs
        if stored != getattr(config.model, key):
            raise ConfigError(f"cannot resume from {source.describe()}: it was saved with model.{key} = "
                              f"{stored!r}, this run has {getattr(config.model, key)!r}")
    name = source.manifest["optimizer"]["name"]
    if name != config.train.optimizer:
        raise ConfigError(f"cannot resume from {source.describe()}: it holds {name} optimizer state, this run "
                          f"uses train.optimizer = {config.train.optimizer!r}")
    expected = sorted(make_optimizer(config.train, np, 0, np.float32).state)
    stored = sorted(source.manifest["optimizer"].get("state", []))
    if stored != expected:
        raise ConfigError(f"cannot resume from {source.describe()}: it holds optimizer state {stored}, this run's "
                          f"optimizer settings need {expected} (train.momentum changed?)")
    lora = {key: saved.get("train", {}).get(key, 0 if key == "lora_rank" else None)
            for key in ("lora_rank", "lora_alpha", "lora_targets")}
    if lora["lora_rank"] != config.train.lora_rank or (config.train.lora_rank and (
            lora["lora_alpha"], lora["lora_targets"]) != (config.train.lora_alpha, config.train.lora_targets)):
        raise ConfigError(f"cannot resume from {source.describe()}: it was saved with train.lora_rank = "
                          f"{lora['lora_rank']}, lora_alpha = {lora['lora_alpha']}, lora_targets = "
                          f"{lora['lora_targets']}; this run has {config.train.lora_rank}, {config.train.lora_alpha}, "
                          f"{config.train.lora_targets} (export --format peft and start from model.adapter instead)")
    if source.step > config.train.steps:
        raise ConfigError(f"cannot resume from {source.describe()}: it is at step {source.step}, beyond "
                          f"train.steps = {config.train.steps}")
    if config.model.init and config.model.init != saved["model"].get("init", ""):
        check_resumed_init(config, source)
    adapter = saved["model"].get("adapter", "")
    if config.model.adapter and config.model.adapter != adapter:
        # the checkpoint holds the adapters its run trained: another file would be ignored in silence
        raise ConfigError(f"cannot resume from {source.describe()}: it was saved with model.adapter = {adapter!r}, "
                          f"this run has {config.model.adapter!r}; --resume continues the adapters the checkpoint "
                          f"holds (leave model.adapter out), and a fresh run (without --resume) starts from another")


def check_resumed_init(config: Config, source: HDF5Source) -> None:
    """Refuse a model.init changed on --resume to another model: the run keeps it (a LoRA export's base)."""
    try:
        merged_if_adapted(resolve_weights(config.model.init, "model.init")).check(
            base_specs(model_def(config).specs), "model.init")
    except ConfigError as exc:
        saved = source.manifest["config"]["model"].get("init", "")
        raise ConfigError(f"{exc} (resuming {source.describe()}, saved with model.init = {saved!r}: --resume "
                          f"continues the checkpoint's weights, and a new model.init must hold the same model, as it "
                          f"names a LoRA export's base; leave model.init out)") from None


def check_training_format(config: Config) -> None:
    """Refuse a model.weight_format other than auto / float32 (training and the planner, which plans training)."""
    if config.model.weight_format not in ("auto", "float32"):
        raise ConfigError(f"model.weight_format = {config.model.weight_format!r}: training keeps float32 weights; the "
                          f"weight formats are for generate, serve and evaluate (leave it \"auto\" or \"float32\")")


def prepare(config: Config, world_size: int, layout: tuple[int, int] | None = None) -> TrainSetup:
    """Check config against the world size, data and weights files; lower and validate the schedule.

    ``layout``: the (dp, pp) the caller resolved already (the train command, whose message about a resumed
    run's layout says where it came from); None resolves it here.
    """
    check_training_format(config)
    check_backend(config.run.backend)   # here, not in the Trainer: a rank's own error there was every rank's line
    dp, pp = layout if layout is not None else resolve_layout(config, world_size)
    par, tr = config.parallel, config.train
    n_stages = pp * par.virtual_stages
    specs = model_def(config).specs
    ranges = partition(specs, n_stages, stage_counts(config, n_stages, tr.micro_batch_size))
    init = resume = None
    if config.checkpoint.dir:
        check_checkpoint_dir(config.checkpoint.dir, config.checkpoint.resume)
    if config.checkpoint.resume:
        resume = resolve_weights(config.checkpoint.dir, "checkpoint.dir", NOTHING_TO_RESUME)
        if resume.kind != "checkpoint":
            raise ConfigError(f"checkpoint.dir {config.checkpoint.dir!r} is a file, not a checkpoint directory")
        check_nothing_newer(resume)     # first: a live run there changes everything below under our feet
        # a checkpoint of the other model kind is said first, then what differs in the model or optimizer
        check_kind(resume.model, resume.n_layers, specs, f"checkpoint.dir {str(resume.path)!r}")
        check_resume(config, resume)
        resume.check(specs, "checkpoint.dir")
    elif config.model.init:
        # a LoRA run's checkpoint starts a run as its merged model; a LoRA run's base holds no adapters
        init = merged_if_adapted(resolve_weights(config.model.init, "model.init"))
        init.check(base_specs(specs), "model.init")
    # after the weights: a model.init of another kind is said as such, not as data of the wrong shape for this one
    samples = check_data_file(config) if config.data.path else config.data.synthetic_samples
    adapter = None
    if config.model.adapter and not config.checkpoint.resume:
        adapter = read_adapter(config.model.adapter)
        check_adapter(adapter, config.model.kind, config.to_dict()["model"], specs)
    check_log_files(config, init, resume)
    try:
        shape = shape_of(par.schedule, pp, tr.micro_batches, par.virtual_stages)
        programs = lower(build_schedule(par.schedule, pp, tr.micro_batches, par.virtual_stages), shape)
        validate_programs(programs, shape)
    except ScheduleError as exc:
        # an unsupported (schedule, pp, micro-batches, virtual stages) is a configuration error:
        # refused on every rank before the first collective
        raise ConfigError(f"parallel.schedule = {par.schedule!r}: {exc}") from None
    check_memory(config, ranges, pp, shape.placement, world_size)
    if config.checkpoint.dir:     # after the memory: a model that cannot even be held is told so first
        check_checkpoint_space(config, pp)
    return TrainSetup(config, dp, shape, ranges, programs, init, resume, run_tokenizer(config, init or resume),
                      adapter, check_eval_data(config, dp), samples)


def run_tokenizer(config: Config, source: WeightsSource | None) -> StoredTokenizer | None:
    """Return the tokenizer a decoder's run saves: data.path's, else its weights' (checked); None when neither has one.

    Training reads token ids: a Hugging Face directory of weights alone (no tokenizer.json) trains on token data
    or synthetic tokens, and its run's checkpoints hold no tokenizer (generate then says so).
    """
    if config.model.kind not in DECODERS:
        return None
    weights_only = source is not None and source.kind == "hf" and not source.has_tokenizer()
    own = source.tokenizer() if source is not None and not weights_only else None
    if config.data.path:
        found = data_tokenizer(config.data.path, config.model.vocab_size)
        if found:
            check_same_tokenizer(found, own, config, source)
            return found
    return own


def check_same_tokenizer(data: StoredTokenizer, own: StoredTokenizer | None, config: Config,
                         source: WeightsSource | None) -> None:
    """Refuse data tokenized otherwise than a Hugging Face model's own tokenizer: its ids would mean other tokens,
    and the run's checkpoints would carry the data's tokenizer instead of the model's (it was replaced silently)."""
    if own is None or own.kind != "hf" or source is None:
        return
    mine = dict(own.files).get("tokenizer.json")
    if data.kind == "hf" and dict(data.files).get("tokenizer.json") == mine:
        return
    what = "another Hugging Face tokenizer" if data.kind == "hf" else f"the {data.kind} tokenizer"
    model_dir = config.model.init if is_hf_directory(config.model.init) else "HF_DIR"
    raise ConfigError(f"data.path {config.data.path!r} was tokenized with {what}, but the model ({source.describe()}) "
                      f"has its own Hugging Face tokenizer: the data's token ids would mean other tokens to it; "
                      f"tokenize the text with the model's: python examples/text_to_hdf5.py TEXT --tokenizer "
                      f"{model_dir}")
