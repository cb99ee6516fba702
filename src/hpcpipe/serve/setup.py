"""Planning a generation or serving run on every rank with no collective: model, layout, tokenizer, limits.

The model comes from the weights' ``model`` attribute (a checkpoint's
manifest) when present, else from ``--config``/``--set``; the config may
restate a stored key but not contradict it. The layout comes from
``[parallel]`` (one stage per rank), the serving limits from ``[serve]``, and
text is encoded and decoded with the weights' ``tokenizer`` attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpcpipe.config import Config, from_dict, load_raw, resolve_layout
from hpcpipe.errors import ConfigError
from hpcpipe.nn.gpt_params import GPTShape
from hpcpipe.nn.model import partition
from hpcpipe.nn.model_spec import gpt_shape, model_specs
from hpcpipe.profiles.stage_cut import stage_counts
from hpcpipe.state.kinds import GPT_KEYS, restate_stored_model
from hpcpipe.state.sources import WeightsSource, resolve_weights
from hpcpipe.state.tokenizer import Tokenizer

STORED_KEYS = ("kind", *GPT_KEYS, "dtype")


@dataclass(frozen=True)
class ServeSetup:
    """Everything decided before the first collective (identical on every rank)."""

    config: Config
    dp: int
    pp: int
    stage_ranges: list[range]
    weights: WeightsSource
    shape: GPTShape
    tokenizer: Tokenizer
    model_name: str

    @property
    def groups(self) -> int:
        """Micro-batch groups the running sequences of a replica are spread over."""
        return self.config.serve.micro_batches or self.pp


def _tokenizer(source: WeightsSource, given: str, vocab: int) -> Tokenizer:
    text = source.tokenizer()
    if text is None:
        raise ConfigError(f"--weights {given!r} has no tokenizer attribute, so prompts cannot be turned into "
                          f"tokens; train on data written by examples/text_to_hdf5.py (its tokenizer is saved "
                          f"with every checkpoint), or set the root attribute tokenizer = '{{\"kind\": \"bytes\"}}'")
    tokenizer = Tokenizer.from_json(text)
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"--weights {given!r}: its tokenizer has {tokenizer.vocab_size} tokens but the model's "
                          f"vocabulary is model.vocab_size = {vocab}")
    return tokenizer


def prepare(weights: str | Path, world_size: int, config: str | Path | None = None,
         overrides: list[str] | tuple[str, ...] = ()) -> ServeSetup:
    """Check weights, model, layout and tokenizer locally; ConfigError names what is wrong."""
    given = str(weights)
    source = resolve_weights(weights, "--weights")
    if source.model and source.model_kind != "gpt":
        raise ConfigError(f"--weights {given!r} holds an MLP model ({source.n_layers} layers): text generation "
                          f"needs a GPT (model.kind = \"gpt\"); MLPs run with python -m hpcpipe.infer")
    raw = restate_stored_model(load_raw(config, overrides), source.model, source.describe(), STORED_KEYS)
    raw["model"].setdefault("kind", "gpt")
    cfg = from_dict(raw)
    if cfg.model.kind != "gpt":
        raise ConfigError(f"model.kind = {cfg.model.kind!r}: text generation needs a GPT (model.kind = \"gpt\")")
    if cfg.parallel.virtual_stages != 1:
        raise ConfigError(f"generation runs one stage per rank: parallel.virtual_stages must be 1, got "
                          f"{cfg.parallel.virtual_stages}")
    dp, pp = resolve_layout(cfg, world_size)
    specs = model_specs(cfg)
    # a decode step is a forward: "profile" balances the measured forwards
    ranges = partition(specs, pp, stage_counts(cfg, pp, max(1, cfg.serve.max_sequences // pp), ("F",)))
    source.check(specs, "--weights")
    shape = gpt_shape(cfg)
    tokenizer = _tokenizer(source, given, shape.vocab)
    name = cfg.serve.model_name or Path(given.rstrip("/")).name or "hpcpipe"
    return ServeSetup(cfg, dp, pp, ranges, source, shape, tokenizer, name)
