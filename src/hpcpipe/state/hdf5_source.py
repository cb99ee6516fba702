"""An hpcpipe weights file or a committed checkpoint as a :class:`hpcpipe.state.weights_source.WeightsSource`.

A weights file holds every layer (``/layers/NNNN``); a checkpoint holds one file per pipeline stage,
each with its own layers by global index, and a manifest naming which file holds which layer with its
size and SHA-256. :class:`HDF5Source` reads either by global index, checking each checkpoint file (size,
SHA-256, names, shapes) before its first use. Build it with :func:`file_source` or
:func:`checkpoint_source` (or :func:`hpcpipe.state.sources.resolve_weights`, which picks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError, UsageError
from hpcpipe.hf.json_text import JSONTextError, loads
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.kinds import check_kind, count_text, specs_kind, stored_kind
from hpcpipe.state.manifest import check_stage_file, manifest_specs, read_manifest
from hpcpipe.state.tokenizer import StoredTokenizer, read_stored
from hpcpipe.state.weights import (
    LayerArrays,
    OptimizerArrays,
    check_layers,
    check_weights,
    open_checked,
    read_layers,
    read_optimizer,
    stored_layers,
)
from hpcpipe.state.weights_source import Shards


@dataclass(frozen=True)
class HDF5Source:
    """Where each global layer of a model is stored: one weights file or the files of one checkpoint.

    ``read`` returns layers by global index whatever layout wrote them; for a checkpoint each file's
    size and SHA-256 are checked against the manifest before its first use (once per file).
    """

    path: Path                         # the file or step directory that was resolved
    kind: str                          # "file" | "checkpoint"
    step: int
    n_layers: int
    model: dict[str, Any]              # the model config stored with the weights ({} when unknown)
    files: dict[int, Path]             # global layer -> file holding it
    manifest: dict[str, Any] | None = None
    specs: list[Any] | None = None     # the model of a checkpoint's manifest
    _verified: set[Path] = field(default_factory=set, compare=False, repr=False)   # files checked so far

    def _entry(self, path: Path) -> dict[str, Any]:
        return next(e for e in self.manifest["files"] if e["name"] == path.name)

    def verify_file(self, path: Path) -> None:
        """Check one of a checkpoint's files against its manifest (size, SHA-256, step, names, shapes), once."""
        if self.manifest is not None and path not in self._verified:
            check_stage_file(self.path, self._entry(path), self.manifest, self.specs)
            self._verified.add(path)

    def is_partial(self) -> bool:
        """Whether this is a weights file holding only some of the model's layers."""
        return self.kind == "file" and sorted(self.files) != list(range(self.n_layers))

    def is_stage_file(self) -> bool:
        """Whether this is one stage's file of a checkpoint: a partial file beside a step's manifest."""
        return self.is_partial() and (self.path.parent / cf.MANIFEST).is_file()

    def partial(self) -> str:
        """'' for a whole model; for a weights file holding only some layers (one stage's file of a checkpoint) what
        it holds: "layers [3, 4, 5] of 6, one stage's file of the checkpoint 'ck/step-00000020'"."""
        if not self.is_partial():
            return ""
        whose = (f"one stage's file of the checkpoint {str(self.path.parent)!r}" if self.is_stage_file()
                 else "not a whole model")
        return f"layers {sorted(self.files)} of {self.n_layers}, {whose}"

    def require_whole(self, reader: str) -> None:
        """Raise UsageError when this is a file of some layers only (one stage's file of a checkpoint): ``reader``
        (an export, a run) needs the whole model, which the step directory holds."""
        if self.is_partial():
            where = (f"pass the step directory {str(self.path.parent)!r}" if self.is_stage_file()
                     else "pass a whole model")
            raise UsageError(f"{self.describe()} holds only {self.partial()}: {reader} reads a whole model; {where}")

    def _by_file(self, indices: list[int]) -> dict[Path, list[int]]:
        missing = [i for i in indices if i not in self.files]
        if missing:
            raise ConfigError(f"{self.describe()} has no layer(s) {missing} (it holds {self.n_layers} layers)")
        out: dict[Path, list[int]] = {}
        for i in indices:
            out.setdefault(self.files[i], []).append(i)
        return out

    def describe(self) -> str:
        """Return a short human label, e.g. "checkpoint '/ck/step-00000006'"."""
        return f"{'checkpoint' if self.kind == 'checkpoint' else 'weights file'} {str(self.path)!r}"

    @property
    def model_kind(self) -> str:
        """The kind of the stored model: "mlp" (also when none is recorded) or "gpt"; ConfigError if unknown."""
        return stored_kind(self.model, self.describe())

    def check(self, specs: list[Any], key: str = "") -> None:
        """Raise ConfigError unless kind, layer count, names and shapes match the model (metadata only).

        ``key`` names what the user set (``model.init``, ``checkpoint.dir``, ``--weights``)
        in the message about a file of the other model kind, which comes first.
        """
        check_kind(self.model, self.n_layers, specs, f"{key} {str(self.path)!r}" if key else self.describe())
        if self.n_layers != len(specs):
            kind = specs_kind(specs)
            raise ConfigError(f"{self.describe()} holds {count_text(kind, self.n_layers)} but "
                              f"{'model.dims' if kind == 'mlp' else 'the model config'} describes {len(specs)}")
        if self.kind == "file":
            if self.is_stage_file():   # another partial file: check_weights names the layers missing
                self.require_whole(key or "the command")
            check_weights(self.path, specs)
            return
        for path, indices in self._by_file([s.index for s in specs]).items():
            label = f"checkpoint file {str(path)!r}"
            if not path.is_file():
                raise ConfigError(f"{label} is missing")
            with open_checked(path) as f:
                check_layers(f, [specs[i] for i in indices], label)

    def tokenizer(self, verify: bool = True) -> StoredTokenizer | None:
        """Return the tokenizer stored with the weights (attribute, and files for kind hf), None when there is none.

        For a checkpoint it is read from the file holding layer 0 (every stage file
        carries it), after that file's checks unless ``verify`` is False; an invalid
        value is a ConfigError naming the file.
        """
        path = self.files.get(0, self.path)
        if self.kind == "checkpoint" and verify:
            self.verify_file(path)
        with open_checked(path) as f:
            return read_stored(f, f"{'checkpoint' if self.kind == 'checkpoint' else 'weights'} file {str(path)!r}")

    def read(self, indices: list[int], shards: Shards | None = None) -> LayerArrays:
        """Return {layer: {parameter name: array}} for the given global layers; ConfigError naming a bad file.

        ``shards(index, names)``: only this tensor-parallel rank's part of each tensor (hyperslab reads).
        """
        out: LayerArrays = {}
        for path, mine in self._by_file(indices).items():
            self.verify_file(path)
            out.update(read_layers(path, mine, shards))
        return out

    def read_optimizer(self, indices: list[int], shards: Shards | None = None
                       ) -> tuple[dict[str, Any], OptimizerArrays]:
        """Return (optimizer attributes, per-layer optimizer state) for the given layers (checkpoints only)."""
        if self.kind != "checkpoint":
            raise ConfigError(f"{self.describe()} is a weights file and holds no optimizer state")
        attrs: dict[str, Any] = {}
        out: OptimizerArrays = {}
        for path, mine in self._by_file(indices).items():
            self.verify_file(path)
            attrs, part = read_optimizer(path, mine, shards)
            out.update(part)
        return attrs, out

    def matrix_itemsize(self) -> int:
        """4: an hpcpipe file's matrices are read as float32 arrays, which a stored-format stage keeps as float32."""
        return 4

    def forward_only(self, dtype: str, half_embedding: bool = False, stored: bool = False,
                     quantize: bool = False) -> Any:
        """This source itself: its arrays come as stored (float32) and the reader converts them; a checkpoint of a
        LoRA run reads as its merged model (hpcpipe.state.adapters)."""
        from hpcpipe.state.adapters import merged_if_adapted
        return merged_if_adapted(self)


def file_source(path: Path) -> HDF5Source:
    """Return the source of one hpcpipe weights file (format and root attributes checked, layers not yet read)."""
    with open_checked(path) as f:
        layers = stored_layers(f)
        n_layers = int(f.attrs.get("n_layers", len(layers)))
        try:
            model = loads(f.attrs.get("model", "{}"))
        except (JSONTextError, TypeError) as exc:
            raise ConfigError(f"weights file {str(path)!r}: root attribute model is not JSON text ({exc})") from None
        if not isinstance(model, dict):
            raise ConfigError(f"weights file {str(path)!r}: root attribute model must be a JSON object, "
                              f"got {type(model).__name__}")
        step = int(f.attrs.get("step", 0))
    return HDF5Source(path, "file", step, n_layers, model, {i: path for i in layers})


def checkpoint_source(step_dir: str | Path) -> HDF5Source:
    """Return the source of one committed checkpoint directory (manifest validated, files not yet hashed)."""
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    files = {int(i): step_dir / e["name"] for e in manifest["files"] for i in e["layers"]}
    specs = manifest_specs(manifest, f"manifest {str(step_dir / cf.MANIFEST)!r}")
    return HDF5Source(step_dir, "checkpoint", int(manifest["step"]), int(manifest["n_layers"]),
                         manifest["config"]["model"], files, manifest, specs)
