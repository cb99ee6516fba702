"""Setting up a generation or serving run on every rank with no collective: model, layout, tokenizer, memory.

The model comes from the weights (a weights file's ``model`` attribute, a checkpoint's manifest, a
Hugging Face directory's config.json) when they record one, else from ``--config``/``--set``; the
config may restate a stored key but not contradict it, except ``model.seq_len`` of a Llama-family
Hugging Face model, which may be set shorter than its config.json's context (the KV cache is
allocated for ``serve.max_sequences`` sequences of ``seq_len`` tokens). The layout comes from
``[parallel]``; when neither the config file nor ``--set`` gives ``parallel.pp``, every rank is a stage
(pp = world size / (dp x tp) when parallel.dp is given, else the largest divisor of world size / tp the layer
count allows whose dp, the rest, parallel.ep divides) instead of training's default pp = 4, so
``mpiexec -n 2 python -m hpcpipe.generate`` needs no ``--set parallel.pp=2``, with or without other parallel
keys. The
serving limits come from ``[serve]``, and text is encoded and decoded with the tokenizer stored with the
weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hpcpipe.config import DECODERS, Config, from_dict, load_raw, resolve_layout
from hpcpipe.errors import ConfigError
from hpcpipe.kernels.formats import Q8_BLOCK, inference_format
from hpcpipe.nn.core.fused_stage import compiled_available, tp_q8_problem
from hpcpipe.nn.memory import decode_rank_bytes, kv_window, pool_pages, ring_pages, ring_window, sequence_pages
from hpcpipe.nn.partition import partition
from hpcpipe.nn.registry import KINDS as KIND_REGISTRY
from hpcpipe.nn.registry import model_def
from hpcpipe.profiles.stage_cut import stage_counts
from hpcpipe.runtime.backend import runs_on_gpu
from hpcpipe.runtime.host_memory import rank_share
from hpcpipe.runtime.launcher import local_rank_count
from hpcpipe.state.adapters import with_peft
from hpcpipe.state.kinds import restate_stored_shape
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.tokenizer import StoredTokenizer, check_vocabulary
from hpcpipe.state.weights_source import WeightsSource

if TYPE_CHECKING:
    from hpcpipe.nn.core.decoder_model import DecoderModel, DecoderShape

GIB = 1024 ** 3
Q8_BYTES = 1 + 2 / Q8_BLOCK        # a q8_0 value: its int8 and its share of the block's float16 scale
MatrixBytes = Callable[[tuple[int, ...]], float]


class TPPlace(NamedTuple):
    """A tensor-parallel rank's place (what compiled_available asks of a tp group), before any group exists."""

    size: int
    rank: int


@dataclass(frozen=True)
class ServeSetup:
    """Everything decided before the first collective (identical on every rank), complete when built."""

    config: Config
    dp: int
    pp: int
    stage_ranges: list[range]
    weights: WeightsSource       # reading in model.dtype (WeightsSource.forward_only)
    model: DecoderModel          # the decoder's kind and shape (hpcpipe.nn.registry.model_def)
    stored_tokenizer: StoredTokenizer
    model_name: str
    tp: int = 1                  # tensor-parallel ranks per stage (parallel.tp)
    draft: ServeSetup | None = None   # serve.draft's model (speculative decoding), one stage on each replica's head
    # what a request (or generate) leaving temperature, top_p or top_k out samples with: the model's
    # generation_config.json (serve.generation_config = "auto"); {}: OpenAI's defaults ("none", or a draft)
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def shape(self) -> DecoderShape:
        """The decoder's shape."""
        return self.model.shape

    @property
    def groups(self) -> int:
        """Micro-batch groups the running sequences of a replica are spread over."""
        return self.config.serve.micro_batches or self.pp

    @property
    def tokenizer(self) -> Any:
        """The working tokenizer (Tokenizer for bytes/chars, HFTokenizer for a Hugging Face model)."""
        return self.stored_tokenizer.load()

    @property
    def kv_blocks(self) -> int:
        """KV blocks in each stage's pool (serve.kv_blocks, 0: serve.max_sequences whole contexts or windows)."""
        return pool_pages(self.config, self.model)

    @property
    def kv_window(self) -> int:
        """The sliding window under which sequences give back KV blocks (hpcpipe.nn.memory.kv_window), or 0."""
        return kv_window(self.config, self.model)

    @property
    def kv_ring(self) -> int:
        """KV blocks of each slot's ring for the windowed blocks of a model mixing them with full-attention blocks
        (hpcpipe.nn.memory.ring_pages), or 0."""
        return ring_pages(self.config, self.model)

    @property
    def ring_window(self) -> int:
        """The window of the blocks kept in rings (hpcpipe.nn.memory.ring_window), or 0."""
        return ring_window(self.config, self.model)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a sequence (the model's end-of-sequence ids; none for bytes and chars)."""
        return self.stored_tokenizer.eos_ids()


def _tokenizer(source: WeightsSource, given: str, vocab: int, key: str = "--weights") -> StoredTokenizer:
    stored = source.tokenizer()
    if stored is None:
        raise ConfigError(f"{key} {given!r} has no tokenizer attribute, so prompts cannot be turned into "
                          f"tokens; train on data written by examples/text_to_hdf5.py (its tokenizer is saved "
                          f"with every checkpoint), or set the root attribute tokenizer = '{{\"kind\": \"bytes\"}}'")
    check_vocabulary(stored, vocab, f"{key} {given!r}")
    return stored


def _model_config(source: WeightsSource, given: str, raw: dict[str, Any], key: str = "--weights") -> dict[str, Any]:
    """Return raw with the stored model's keys restated (a Hugging Face llama's seq_len may be shortened)."""
    if not source.model:
        raw.setdefault("model", {}).setdefault("kind", "gpt")
        return raw
    if source.model_kind not in DECODERS:
        raise ConfigError(f"{key} {given!r} holds an MLP model ({source.n_layers} layers): text generation "
                          f"needs a GPT or a Llama-family model; MLPs run with python -m hpcpipe.infer")
    return restate_stored_shape(raw, source)


def check_decode_memory(cfg: Config, ranges: list[range], world_size: int, available: int | None = None,
                        headroom: int | None = None, matrix_bytes: MatrixBytes | None = None,
                        draft: tuple[int, int] = (0, 0), smaller: dict[str, MatrixBytes] | None = None,
                        seq_len_free: bool = True) -> None:
    """Raise ConfigError when a rank's parameters and KV cache exceed its share of this node's memory.

    The share is the smaller of the node's available memory over its ranks and this process's address-space
    headroom (ulimit -v); ``available`` and ``headroom`` decide instead of measuring (tests). ``matrix_bytes``:
    the blocks' matrices in model.weight_format (:func:`format_bytes`); ``draft``: (parameters, KV cache) bytes
    of serve.draft's model, which the first stage's rank holds besides its own (:func:`draft_bytes`); ``smaller``:
    the weight formats the stages could keep instead (:func:`smaller_formats`), named when one of them fits.
    ``seq_len_free``: whether model.seq_len may be set below the weights' (else the hint does not name it).
    """
    if runs_on_gpu(cfg.run.backend):
        return        # the stages' weights and caches live in GPU memory ("auto" where a GPU is seen too)
    head = decode_rank_bytes(cfg, ranges[:1], matrix_bytes)
    params, cache = max((head[0] + draft[0], head[1] + draft[1]), decode_rank_bytes(cfg, ranges[1:], matrix_bytes),
                        key=sum)
    ranks_here = local_rank_count(default=world_size)   # a tp rank holds about 1/tp of its stage (counted)
    share, how = rank_share(ranks_here, available, headroom)
    if share is not None and params + cache > share:
        with_draft = f" with serve.draft's model ({sum(draft) / GIB:.3g} GiB)" if sum(draft) else ""
        hint = _memory_hint(cfg, params, cache, share, seq_len_free)
        for fmt, per_value in (smaller or {}).items():     # a bf16 checkpoint widened to float32 takes twice its bytes
            need = max(sum(decode_rank_bytes(cfg, ranges[:1], per_value)) + sum(draft),
                       sum(decode_rank_bytes(cfg, ranges[1:], per_value)))
            if need <= share:
                hint = (f"keep the matrices in weight format {fmt} (--set model.weight_format='\"{fmt}\"': about "
                        f"{need / GIB:.3g} GiB a rank, docs/kernels.md), or {hint}")
                break
        raise ConfigError(
            f"a rank needs about {(params + cache) / GIB:.3g} GiB{with_draft} (parameters {params / GIB:.3g} GiB, "
            f"KV cache {cache / GIB:.3g} GiB for {kv_pool(cfg)}); {how}: {hint}")


def kept_format(cfg: Config, model: Any, on_gpu: bool | None = None) -> str:
    """The weight format the stages compute in (serve.engine's choice: model.weight_format, "auto" as the compiled
    stage allows it; without compiled stages, expert-parallel or on a GPU, "auto" is float32). ``on_gpu``: whether
    the stages run on CuPy (None: as run.backend picks it here, "auto" on CuPy where a GPU is seen)."""
    gpu = runs_on_gpu(cfg.run.backend) if on_gpu is None else on_gpu
    return inference_format(cfg.model.weight_format, _compiled(cfg, model, gpu))


def _compiled(cfg: Config, model: Any, gpu: bool) -> bool:
    """Whether the compiled CPU stage runs every stage of this layout (DecodeStage's choice, serve.engine's ep)."""
    tp = cfg.parallel.tp
    ranks = [TPPlace(tp, r) for r in range(tp)] if tp > 1 else [None]
    return (cfg.parallel.ep == 1 and not gpu
            and all(compiled_available(np, cfg.model.dtype, place, model) for place in ranks))


def widens_format(cfg: Config, model: Any, on_gpu: bool | None = None) -> bool:
    """Whether the stages hold float32 matrices although :func:`kept_format` is stored or q8_0: the NumPy steps of
    a CPU stage (the moe kind, ep > 1, a float64 run, no compiled kernels) widen every matrix to the run's dtype
    once read (q8_0's values rounded first); only the compiled stage and a GPU stage's row products keep them."""
    gpu = runs_on_gpu(cfg.run.backend) if on_gpu is None else on_gpu
    if kept_format(cfg, model, gpu) == "float32":
        return False
    if gpu:                          # DecodeStage's keeps_compact: float32 NumPy steps of a model without experts
        return not (np.dtype(cfg.model.dtype) == np.float32 and model.fusable() and cfg.parallel.ep == 1)
    return not _compiled(cfg, model, gpu)


def format_bytes(cfg: Config, model: Any, source: WeightsSource) -> MatrixBytes | None:
    """Bytes per value of a block's (in, out) matrix in the weight format the stages will keep
    (:func:`kept_format`), or None where that is float32 or counted so (an upper bound)."""
    if cfg.parallel.ep > 1 or runs_on_gpu(cfg.run.backend):
        return None       # experts are widened to float32; a GPU stage's compact choice is made there ("auto" too)
    fmt = kept_format(cfg, model)
    if fmt == "float32" or widens_format(cfg, model):     # counted at 1 or 2 bytes, held at 4: a rank ran short
        return None
    stored = source.matrix_itemsize()
    if fmt == "stored":
        return lambda shape: stored
    return lambda shape: Q8_BYTES if shape[0] % Q8_BLOCK == 0 else stored     # q8_0: whole blocks of 32 inputs


def smaller_formats(cfg: Config, model: Any, source: WeightsSource) -> dict[str, MatrixBytes]:
    """The weight formats other than model.weight_format in which this layout's stages would keep their matrices in
    fewer bytes (stored: a 16-bit checkpoint's 2 bytes a value, exact; q8_0: 34 bytes a block of 32), each with its
    :func:`format_bytes`; none where the stages widen every format (:func:`widens_format`)."""
    now = format_bytes(cfg, model, source)
    block = (Q8_BLOCK, Q8_BLOCK)
    held = now(block) if now is not None else np.dtype(cfg.model.dtype).itemsize
    out = {}
    tp = cfg.parallel.tp
    for fmt in ("stored", "q8_0"):
        if fmt == "q8_0" and tp > 1 and any(tp_q8_problem(model, TPPlace(tp, r)) for r in range(tp)):
            continue                  # refused at this tp (its row-parallel inputs are no whole q8_0 blocks)
        per_value = format_bytes(replace(cfg, model=replace(cfg.model, weight_format=fmt)), model, source)
        if per_value is not None and per_value(block) < held:
            out[fmt] = per_value
    return out


def draft_bytes(cfg: Config, model: Any, draft: ServeSetup) -> tuple[int, int]:
    """(parameters, KV cache) bytes of serve.draft's model on the head's rank: whole, in float32, with a pool of
    as many KV blocks as the model's stages (serve.engine.build_proposer)."""
    serve = replace(cfg.serve, kv_blocks=pool_pages(cfg, model))
    dcfg = replace(draft.config, serve=serve, parallel=replace(draft.config.parallel, tp=1, ep=1))
    return decode_rank_bytes(dcfg, [range(draft.shape.n_groups)])


def _memory_hint(cfg: Config, params: int, cache: int, share: int, seq_len_free: bool = True) -> str:
    """What would fit in a rank's share: the KV cache grows linearly in seq_len and in max_sequences, so the values
    named are below the ones given (a fixed example once suggested a seq_len above the model's context)."""
    if params >= share or cache == 0:
        return "the parameters alone do not fit: use more stages (parallel.pp) or tensor parallelism (parallel.tp)"
    if cfg.serve.kv_blocks:       # the pool is sized by its blocks
        fits = cfg.serve.kv_blocks * (share - params) // cache
        return f"lower serve.kv_blocks (at most {fits} fit: --set serve.kv_blocks={fits}), or use more stages"
    seq_len, sequences = cfg.model.seq_len, cfg.serve.max_sequences
    fits_len = seq_len * (share - params) // cache
    fits_len = fits_len // 256 * 256 if fits_len >= 512 else fits_len      # a round number when there is room
    fits_seq = sequences * (share - params) // cache
    ways = []
    if cfg.serve.kv_block > seq_len:      # every sequence holds a whole block, most of it past the context
        ways.append(f"lower serve.kv_block to at most model.seq_len (--set serve.kv_block={min(16, seq_len)}: a "
                    f"block of {cfg.serve.kv_block} positions is longer than a whole context)")
    if fits_seq >= 1:
        ways.append(f"lower serve.max_sequences (at most {fits_seq} fit: --set serve.max_sequences={fits_seq})")
    if fits_len >= 2 and seq_len_free:    # a GPT's weights fix its context: they refuse a shorter one
        ways.append(f"lower model.seq_len (at most {fits_len} tokens fit: --set model.seq_len={fits_len})")
    return ", or ".join([*ways, "use more stages"])


def kv_pool(cfg: Config) -> str:
    """The KV cache's size in words: its pool of KV blocks and what it is sized by."""
    srv = cfg.serve
    if srv.kv_blocks:
        return f"serve.kv_blocks = {srv.kv_blocks} KV blocks of serve.kv_block = {srv.kv_block} positions"
    return (f"serve.max_sequences = {srv.max_sequences} sequences of model.seq_len = {cfg.model.seq_len} tokens, "
            f"in KV blocks of serve.kv_block = {srv.kv_block} positions")


def stages_per_world(world_size: int, n_layers: int, ep: int = 1) -> int:
    """Pipeline stages when the config gives no pp: one per rank, or as many as the layers allow (the largest
    divisor of the world size not above the layer count whose dp, the rest, parallel.ep divides)."""
    fits = [d for d in range(1, min(world_size, n_layers) + 1) if world_size % d == 0]
    return max([d for d in fits if (world_size // d) % ep == 0] or fits)


def decode_layout(raw: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Return raw config sections with parallel.pp decided when neither the config file nor ``--set`` gives it.

    With parallel.dp given, pp = world size / (dp x tp); else :func:`stages_per_world` of the world size / tp,
    with parallel.ep respected. A given pp wins; training's default pp = 4 is never used. ConfigError when
    parallel.virtual_stages is not 1 (a decode step runs each stage once).
    """
    par = raw.get("parallel", {})
    if not isinstance(par, dict):
        return raw                         # from_dict names what [parallel] should be
    vs = par.get("virtual_stages", 1)
    if isinstance(vs, int) and vs != 1:
        raise ConfigError(f"generation runs one stage per rank: parallel.virtual_stages must be 1, got {vs}")
    if "pp" in par:
        return raw
    # the model's layer groups, from the keys as given (pp = 1 fits any model)
    n_layers = from_dict({**raw, "parallel": {**par, "pp": 1}}).n_layers
    tp, dp, ep = par.get("tp", 1), par.get("dp", "auto"), par.get("ep", 1)
    if dp != "auto":
        pp: int | str = "auto"             # world size / (dp x tp); resolve_layout names a mismatch
    else:
        grid = world_size // tp if world_size % tp == 0 else world_size   # resolve_layout names a tp mismatch
        pp = stages_per_world(grid, n_layers, ep)
    return {**raw, "parallel": {**par, "pp": pp}}


def prepare(weights: str | Path, world_size: int, config: str | Path | None = None,
            overrides: list[str] | tuple[str, ...] = (), key: str = "--weights") -> ServeSetup:
    """Check weights, model, layout, tokenizer and memory locally; ConfigError names what is wrong (the weights
    as ``key``: --weights, or serve.draft for a draft model)."""
    given = str(weights)
    source = resolve_weights(weights, key)
    raw = _model_config(source, given, load_raw(config, overrides), key)
    cfg = from_dict(decode_layout(raw, world_size))
    if cfg.model.kind not in DECODERS:
        raise ConfigError(f"model.kind = {cfg.model.kind!r}: text generation needs a GPT or a Llama-family model "
                          f"(model.kind = \"gpt\" or \"llama\")")
    source = source.forward_only(cfg.model.dtype)    # a Hugging Face model is read in the run's dtype
    if cfg.model.adapter:                             # --adapter: a PEFT directory merged into the base
        source = with_peft(source, cfg.model.adapter, cfg)
    dp, pp = resolve_layout(cfg, world_size)
    model = model_def(cfg)
    specs = model.specs
    # a decode step is a forward: "profile" balances the measured forwards
    ranges = partition(specs, pp, stage_counts(cfg, pp, max(1, cfg.serve.max_sequences // pp), ("F",)))
    source.check(specs, key)
    shape = model.shape
    tokenizer = _tokenizer(source, given, shape.vocab, key)
    whole = sequence_pages(cfg, model)
    if cfg.serve.kv_blocks and cfg.serve.kv_blocks < whole:
        window, ring = kv_window(cfg, model), ring_window(cfg, model)
        held = f"one context of model.seq_len = {shape.seq_len} tokens" if not window else \
            f"one sequence's {window}-token sliding window"
        if ring:       # only the windowed blocks keep rings: the pool is the full-attention blocks'
            held += (f", which its full-attention blocks read whole (its blocks with the {ring}-token sliding "
                     f"window keep their own rings)")
        raise ConfigError(f"serve.kv_blocks = {cfg.serve.kv_blocks} KV blocks of serve.kv_block = "
                          f"{cfg.serve.kv_block} positions cannot hold {held}: at least {whole} are needed")
    draft = _draft(cfg, shape.seq_len, tokenizer, shorter=_seq_len_free(source, cfg)) \
        if cfg.serve.speculate == "draft" else None
    check_decode_memory(cfg, ranges, world_size, matrix_bytes=format_bytes(cfg, model, source),
                        draft=draft_bytes(cfg, model, draft) if draft is not None else (0, 0),
                        smaller=smaller_formats(cfg, model, source),
                        seq_len_free=not source.model or _seq_len_free(source, cfg))
    name = cfg.serve.model_name or Path(given.rstrip("/")).name or "hpcpipe"
    # a value no request could carry is refused now, on every rank; a draft proposes greedily: its own are unread
    sampling = {} if key == "serve.draft" or cfg.serve.generation_config == "none" else \
        tokenizer.sampling_defaults(shape.vocab, source.describe())
    return ServeSetup(cfg, dp, pp, ranges, source, model, tokenizer, name, cfg.parallel.tp, draft, sampling)


def _seq_len_free(source: Any, cfg: Config) -> bool:
    """Whether model.seq_len may be set shorter than the weights' context (a Hugging Face RoPE model's)."""
    return getattr(source, "kind", "") == "hf" and KIND_REGISTRY[cfg.model.kind].seq_len_free


def _draft(cfg: Config, seq_len: int, tokenizer: StoredTokenizer, shorter: bool = False) -> ServeSetup:
    """serve.draft's model as one whole stage, checked: a decoder with the same tokenizer and a long enough context
    (``shorter``: the model's model.seq_len may be lowered to the draft's)."""
    where = f"serve.draft {cfg.serve.draft!r}"
    stored = resolve_weights(cfg.serve.draft, "serve.draft")
    saved = (stored.model or {}).get("dtype")
    if getattr(stored, "kind", "") != "hf" and saved and saved != cfg.model.dtype:
        # its prepare below would blame "model.dtype in the configuration", which the user never set
        raise ConfigError(f"{where} was saved in {saved}, but the model computes in {cfg.model.dtype}: a draft "
                          f"decodes in the model's dtype; give a draft saved in {cfg.model.dtype}")
    draft = prepare(cfg.serve.draft, 1, None, ["parallel.pp=1", "parallel.dp=1", f"model.dtype={cfg.model.dtype!r}"],
                    key="serve.draft")
    why = tokenizer_difference(tokenizer, draft.stored_tokenizer)
    if why:
        raise ConfigError(f"{where} has another tokenizer than the model ({why}): a draft model must share the "
                          f"model's tokenizer, since its proposals are the model's token ids")
    if draft.shape.seq_len < seq_len:
        fix = f"set model.seq_len to at most {draft.shape.seq_len}" if shorter else \
            f"give a draft with a context of at least {seq_len} tokens (the model's context is fixed by its weights)"
        raise ConfigError(f"{where} has a context of {draft.shape.seq_len} tokens, shorter than the model's "
                          f"{seq_len}: {fix}")
    return draft


def tokenizer_difference(a: StoredTokenizer, b: StoredTokenizer) -> str:
    """How two stored tokenizers differ (kind, vocabulary, merges, added tokens), or "" when they are the same."""
    if a.kind != b.kind:
        return f"{a.kind} against {b.kind}"
    if a.kind != "hf":
        return "" if json.loads(a.attr) == json.loads(b.attr) else "another vocabulary"
    docs = [json.loads(dict(t.files).get("tokenizer.json", b"{}")) for t in (a, b)]
    for what, pick in (("vocabulary", lambda d: d.get("model", {}).get("vocab")),
                       ("merges", lambda d: d.get("model", {}).get("merges")),
                       ("added tokens", lambda d: [(t.get("id"), t.get("content"))
                                                   for t in d.get("added_tokens", [])])):
        if pick(docs[0]) != pick(docs[1]):
            return f"another {what}"
    return ""
