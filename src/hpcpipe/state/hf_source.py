"""A Hugging Face model directory as a :class:`hpcpipe.state.weights_source.WeightsSource`, as a weights file is.

``--weights HF_DIR`` (generate, serve, evaluate) and ``model.init = "HF_DIR"`` (train) resolve to an
:class:`HFSource`: its model is the hpcpipe kind and [model] keys that config.json describes
(:mod:`hpcpipe.hf.config`), ``read(indices)`` reads only those layer groups' tensors from the
safetensors files (every rank asks for its own stage's groups, so no rank holds the whole model), and
its tokenizer is the directory's tokenizer files. There is no conversion step and nothing is written
into the directory.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.hf.config import HFModel, read_hf_config
from hpcpipe.hf.names import check_names, full_name, group_pieces, read_groups
from hpcpipe.hf.pieces import param_shapes
from hpcpipe.hf.safetensors import TensorFiles, open_tensors
from hpcpipe.nn.core.half_table import HalfTable
from hpcpipe.nn.registry import KINDS
from hpcpipe.runtime.launcher import launcher_rank
from hpcpipe.state.kinds import check_kind, count_text, specs_kind
from hpcpipe.state.tokenizer import StoredTokenizer, from_hf_directory
from hpcpipe.state.weights_source import Shards

CONFIG = "config.json"
# buffers transformers itself skips when it loads (GPT-2's causal mask, old Llama files' RoPE frequencies)
IGNORED = re.compile(r"(^|\.)attn\.(masked_)?bias$|(^|\.)rotary_emb\.inv_freq$")


def is_hf_directory(path: str | Path) -> bool:
    """True when path is a directory holding a Hugging Face config.json (and no hpcpipe checkpoint)."""
    p = Path(path)
    return p.is_dir() and os.path.lexists(p / CONFIG)   # a config.json that is no file is named when it is read


@dataclass(frozen=True)
class HFSource:
    """The layer groups of a Hugging Face model directory, read per group in the dtype it was built with."""

    path: Path
    hf: HFModel
    tensors: TensorFiles
    dtype: str = "float32"
    half_embedding: bool = False    # read tok_emb as a HalfTable when it is stored in 16 bits (forward-only use)
    stored: bool = False            # read matrices as stored: (out, in) RowWeights (forward-only, whole tensors)
    quantize: bool = False          # and each of them made q8_0 once read
    kind: str = field(default="hf", init=False)
    step: int = field(default=0, init=False)
    _tokenizer: list = field(default_factory=list, init=False, compare=False, repr=False)   # read once
    _warned: list = field(default_factory=list, init=False, compare=False, repr=False)      # unused tensors said

    @property
    def n_layers(self) -> int:
        """Number of hpcpipe layer groups: embedding, blocks, final norm (+ head)."""
        return self.hf.n_groups

    @property
    def model(self) -> dict[str, Any]:
        """The hpcpipe [model] keys of the directory's config.json, kind included (rope_scaling {} for none)."""
        keys = {**self.hf.model, "kind": self.hf.kind}
        if "rope_scaling" in keys:
            keys["rope_scaling"] = dict(keys["rope_scaling"] or {})
        return keys

    @property
    def model_kind(self) -> str:
        """gpt (GPT-2) or llama (Llama, Mistral, Qwen2)."""
        return self.hf.kind

    def describe(self) -> str:
        """Return a short human label, e.g. "Hugging Face model '/models/smollm' (llama)"."""
        return f"Hugging Face model {str(self.path)!r} ({self.hf.model_type})"

    def check(self, specs: list[Any], key: str = "") -> None:
        """Raise ConfigError unless kind, group count and every tensor's name and shape match the model.

        Reads the safetensors headers only, no tensor data.
        """
        check_kind(self.model, self.n_layers, specs, f"{key} {str(self.path)!r}" if key else self.describe())
        if self.n_layers != len(specs):
            raise ConfigError(f"{self.describe()} holds {count_text(specs_kind(specs), self.n_layers)} but the "
                              f"model config describes {len(specs)}")
        prefix = check_names(self.hf, self.tensors)
        self._warn_unused(prefix)
        for spec in specs:
            want = dict(spec.shapes)
            pieces = group_pieces(self.hf.kind, self.hf.model, spec.index)
            shapes = param_shapes(pieces)
            if sorted(want) != sorted(shapes):
                raise ConfigError(f"{self.describe()}: layer group {spec.index} holds {sorted(shapes)}"
                                  f", this run's model needs {sorted(want)} (a [model] key contradicts config.json)")
            for piece in pieces:
                name = full_name(piece.hf, prefix)
                info = self.tensors.info(name)
                if info.shape != piece.hf_shape:
                    raise ConfigError(f"tensor {name!r} in {str(info.path)!r} has shape {info.shape}, the config "
                                      f"needs {piece.hf_shape}")
                if tuple(want[piece.name]) != tuple(shapes[piece.name]):
                    raise ConfigError(f"tensor {name!r} in {str(info.path)!r} gives {piece.name} of shape "
                                      f"{piece.shape}, this run's model needs {tuple(want[piece.name])} (a [model] "
                                      f"key contradicts config.json)")

    def unused_tensors(self, prefix: str) -> list[str]:
        """Names of the files' tensors the model does not read (transformers' own ignored buffers aside)."""
        used = {full_name(piece.hf, prefix) for index in range(self.n_layers)
                for piece in group_pieces(self.hf.kind, self.hf.model, index)}
        used.update(prefix + name for index in range(self.n_layers)
                    for name in KINDS[self.hf.kind].hf.zero_only(self.hf.model, index))
        return [name for name in self.tensors.names() if name not in used and not IGNORED.search(name)]

    def _warn_unused(self, prefix: str) -> None:
        """Say once (rank 0) which tensors of the files are left unread: a model that differs from its files is
        worth a line, and real files carry extras (a tied head saved anyway, an adapter merged in by hand)."""
        if self._warned or launcher_rank() != 0:
            return
        self._warned.append(True)
        unused = self.unused_tensors(prefix)
        if unused:
            shown = ", ".join(repr(n) for n in unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
            print(f"hpcpipe: warning: {self.describe()} holds {len(unused)} tensor(s) its config.json's model does "
                  f"not use, ignored: {shown}", file=sys.stderr, flush=True)

    def has_tokenizer(self) -> bool:
        """Whether the directory has a tokenizer.json (a model that is only weights has none)."""
        return (Path(self.path) / "tokenizer.json").exists()

    def tokenizer(self, verify: bool = True) -> StoredTokenizer | None:
        """Return the directory's tokenizer (tokenizer.json and the files beside it)."""
        if not self._tokenizer:
            self._tokenizer.append(from_hf_directory(self.path))
        return self._tokenizer[0]

    def read(self, indices: list[int], shards: Shards | None = None) -> dict[int, dict[str, Any]]:
        """Return {group: {name: array (in, out)}} for the given groups, reading only their tensors.

        With ``stored`` every matrix (or the rank's part of it) comes as it is stored, an (out, in)
        :class:`hpcpipe.kernels.formats.RowWeight` (a weight format's source). With ``half_embedding``, group 0's
        tok_emb stored in bfloat16 or float16 comes as a
        :class:`hpcpipe.nn.core.half_table.HalfTable` of its bits (checked finite), half the bytes of float32.
        ``shards(index, names)``: read only this tensor-parallel rank's part of each tensor.
        """
        indices = list(indices)
        if self.stored:
            return dict(sorted(read_groups(self.hf, self.tensors, indices, np.dtype(self.dtype), shards=shards,
                                           stored=True, quantize=self.quantize).items()))
        half = self._half_table() if self.half_embedding and 0 in indices and shards is None else None
        rest = [i for i in indices if not (half is not None and i == 0)]
        out = read_groups(self.hf, self.tensors, rest, np.dtype(self.dtype), shards=shards)
        if half is not None:
            out[0] = {**read_groups(self.hf, self.tensors, [0], np.dtype(self.dtype), skip=("tok_emb",))[0],
                      "tok_emb": half}
        return dict(sorted(out.items()))

    def _half_table(self) -> HalfTable | None:
        """tok_emb as a HalfTable when the file stores it in 16 bits, else None."""
        name = full_name(next(p.hf for p in group_pieces(self.hf.kind, self.hf.model, 0) if p.name == "tok_emb"),
                         check_names(self.hf, self.tensors))
        info = self.tensors.info(name)
        if info.dtype not in ("BF16", "F16"):
            return None
        table = HalfTable(self.tensors.read(name, np.uint16), "bfloat16" if info.dtype == "BF16" else "float16",
                          np.dtype(self.dtype))
        bad = table.non_finite()
        if bad:
            raise ConfigError(f"tensor {name!r} in {str(info.path)!r} holds {bad} non-finite value(s) (NaN or Inf)")
        return table

    def read_optimizer(self, indices: list[int], shards: Shards | None = None) -> tuple[dict[str, Any], dict]:
        """A Hugging Face model holds no optimizer state: ConfigError."""
        raise ConfigError(f"{self.describe()} holds no optimizer state (it can start a run: model.init, not "
                          f"--resume)")

    def matrix_itemsize(self) -> int:
        """2 when the blocks' matrices are all stored in one 16-bit dtype (bfloat16 or float16), else 4 (headers
        only): a block whose q, k, v (or gate, up) mix dtypes is widened to float32 to be stacked, so a mixed
        checkpoint counts as 4, an upper bound (it counted the first matrix's 2)."""
        dtypes = {self.tensors.info(name).dtype for name in self.tensors.names()
                  if ".layers." in f".{name}" and len(self.tensors.info(name).shape) == 2}
        return 2 if len(dtypes) == 1 and dtypes <= {"BF16", "F16"} else 4

    def forward_only(self, dtype: str, half_embedding: bool = False, stored: bool = False,
                     quantize: bool = False) -> HFSource:
        """A new source reading in ``dtype``, with ``half_embedding`` keeping a 16-bit tok_emb as stored,
        ``stored`` every matrix (or a tp rank's part of it), and ``quantize`` each of them as q8_0 once read."""
        return replace(self, dtype=dtype, half_embedding=half_embedding, stored=stored, quantize=quantize)


def hf_source(path: str | Path, dtype: str = "float32") -> HFSource:
    """Return the HFSource of a Hugging Face model directory; ConfigError of one line on anything unsupported."""
    p = Path(path)
    hf = read_hf_config(p)
    return HFSource(p, hf, open_tensors(p), dtype if dtype in ("float32", "float64") else "float32")
