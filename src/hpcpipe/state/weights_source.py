"""The one interface of every source of a model's layers: a weights file, a checkpoint, a Hugging Face directory.

Whatever a user names as weights (``model.init``, ``--weights``, ``checkpoint.dir`` when resuming) is
resolved by :func:`hpcpipe.state.sources.resolve_weights` into a :class:`WeightsSource`:

    ========================  ===========  =========================================================
    what the path holds       kind         implemented by
    ========================  ===========  =========================================================
    one hpcpipe weights file  "file"       :class:`hpcpipe.state.hdf5_source.HDF5Source`
    a committed checkpoint    "checkpoint" :class:`hpcpipe.state.hdf5_source.HDF5Source` (+ its manifest)
    a Hugging Face directory  "hf"         :class:`hpcpipe.state.hf_source.HFSource`
    ========================  ===========  =========================================================

Every source reads layer groups by *global* index whatever layout wrote them, so each rank asks for its
own stage's groups only; ``shards`` narrows that to one tensor-parallel rank's part of every tensor
(hyperslab reads, never the whole tensor). A source is fixed when it is built: what a forward-only reader
wants differently (the dtype a Hugging Face model is read in, a 16-bit embedding table kept as stored) is
a new source from :meth:`WeightsSource.forward_only`, never a field set on a shared one. No MPI here:
:mod:`hpcpipe.state.collective` decides who reads what.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from hpcpipe.state.tokenizer import StoredTokenizer

# (global layer index, its parameter names) -> {name: Shard (hpcpipe.nn.core.sharding)}: one tp rank's parts
Shards = Callable[[int, list[str]], dict[str, Any]]
Arrays = dict[int, dict[str, Any]]                     # layer -> {parameter name: array}
OptimizerState = tuple[dict[str, Any], dict[int, dict[str, dict[str, Any]]]]   # (attributes, layer -> state)


@runtime_checkable
class WeightsSource(Protocol):
    """Where each global layer group of a model is stored, read by global index whatever layout wrote it."""

    @property
    def path(self) -> Path:
        """The file or directory that was resolved (a checkpoint's step directory)."""

    @property
    def kind(self) -> str:
        """"file", "checkpoint" or "hf"."""

    @property
    def step(self) -> int:
        """Completed training steps when the weights were saved (0 for a file without one, and for hf)."""

    @property
    def n_layers(self) -> int:
        """Layer groups stored (an MLP's layers; a decoder's embedding, blocks and final norm)."""

    @property
    def model(self) -> dict[str, Any]:
        """The stored [model] keys ({} when the weights record none)."""

    @property
    def model_kind(self) -> str:
        """The stored model's kind: "mlp" (also when none is recorded), "gpt" or "llama"; ConfigError if unknown."""

    def describe(self) -> str:
        """Return a short human label for messages, e.g. "checkpoint '/ck/step-00000006'"."""

    def check(self, specs: list[Any], key: str = "") -> None:
        """Raise ConfigError unless kind, layer count, names and shapes match the model (metadata only).

        ``key`` names the setting the path came from (``model.init``, ``--weights``) in the message about
        weights of another model kind, which comes first.
        """

    def tokenizer(self, verify: bool = True) -> StoredTokenizer | None:
        """Return the tokenizer stored with the weights, None when there is none (``verify``: hash first)."""

    def read(self, indices: list[int], shards: Shards | None = None) -> Arrays:
        """Return {layer: {parameter name: array}} for the given global layers; ConfigError naming a bad file."""

    def read_optimizer(self, indices: list[int], shards: Shards | None = None) -> OptimizerState:
        """Return (optimizer attributes, per-layer optimizer state); ConfigError unless the source holds some."""

    def matrix_itemsize(self) -> int:
        """Bytes per value of a block's matrix as ``forward_only(stored=True)`` keeps it: 2 for a 16-bit checkpoint's
        (bfloat16, float16), 4 otherwise (float32 values, or float sums merged from adapters)."""

    def forward_only(self, dtype: str, half_embedding: bool = False, stored: bool = False,
                     quantize: bool = False) -> WeightsSource:
        """Return this source as a forward-only reader wants it: parameters in ``dtype`` where the source converts
        (a Hugging Face model's 16-bit tensors), with ``half_embedding`` a 16-bit embedding table kept as stored
        (a rank that only gathers rows from it), and with ``stored`` every matrix (a tp rank's part of it with
        shards) as stored, an (out, in) RowWeight (hpcpipe.kernels.formats), with ``quantize`` each such matrix
        turned to q8_0 as soon as it is read (the stored copy of one matrix at a time). Sources that hold float32 arrays
        return themselves."""
