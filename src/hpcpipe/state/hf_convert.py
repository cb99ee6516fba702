"""Converting between Hugging Face model directories and hpcpipe files: `checkpoint import` and `export --format hf`.

* import: a Hugging Face directory (gpt2, llama, mistral, qwen2) -> one hpcpipe weights file holding
  every layer group in float32, the model's [model] keys and its tokenizer files; written group by group
  into a temporary file beside the output, fsynced, then committed (never over an existing file).
* export: a checkpoint of any layout (or a weights file) of a GPT or llama -> a new directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load:
  config.json, generation_config.json, safetensors (sharded past 5 GB, as transformers writes) and the
  tokenizer files. The directory is built under a temporary name and renamed into place whole; an
  existing path is never written into.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import DECODERS, from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.hf.json_text import JSONTextError, loads
from hpcpipe.hf.names import group_pieces
from hpcpipe.lazy_h5py import h5py
from hpcpipe.nn.registry import model_def
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.child_write import check_space, signals_held, write_in_child
from hpcpipe.state.hf_source import HFSource, hf_source
from hpcpipe.state.outputs import commit_output
from hpcpipe.state.tokenizer import check_vocabulary
from hpcpipe.state.weights import FORMAT, FORMAT_VERSION, layer_group
from hpcpipe.state.weights_source import WeightsSource

SHARD_BYTES = 5 * 1024 ** 3       # transformers' default max_shard_size
# the smallest float32 magnitude each 16-bit dtype rounds to inf (round to nearest even), and its largest value
OVERFLOW = {"float16": (65520.0, 65504.0),
            "bfloat16": (float(np.array(0x7F7F8000, np.uint32).view(np.float32)), 3.3895314e38)}
BLOCK = 1 << 22                   # values checked at a time: no full-size temporary


class OutOfRange(ConfigError):
    """A weight the export's --dtype cannot hold (exit 2: the flag, not the checkpoint, is what to change)."""


def check_range(tensors: dict[str, np.ndarray], dtype: str, label: str) -> None:
    """Raise OutOfRange naming the first tensor and value that is not finite or that ``dtype`` would turn to inf."""
    limit, largest = OVERFLOW.get(dtype, (np.inf, float(np.finfo(np.float32).max)))
    for name, array in sorted(tensors.items()):
        flat = np.asarray(array).reshape(-1)
        for start in range(0, flat.size, BLOCK):
            block = np.abs(flat[start:start + BLOCK], dtype=np.float64)
            bad = np.flatnonzero(~(block < limit))       # NaN and inf fail the comparison too
            if bad.size:
                at = start + int(bad[0])
                value = float(flat[at])
                why = "is not finite (a run that diverged?)" if not np.isfinite(value) else \
                    (f"is beyond {dtype}'s largest value {largest:.6g} (it would be written as inf): export with "
                     f"--dtype float32, or rescale the weights")
                raise OutOfRange(f"{label}: tensor {name!r} holds {value:.6g} at flat index {at}, which {why}; "
                                 f"nothing was written")



def import_hf(directory: str | Path, out: str | Path) -> HFSource:
    """Write a Hugging Face model directory as one hpcpipe weights file; return the HFSource it read.

    Checked first (config, tensor names and shapes, tokenizer, free space); written in a child process into a
    temporary file beside ``out`` (:mod:`hpcpipe.state.child_write`: a full disk, a crash or a stop signal
    leaves nothing behind), then committed, never over an existing file.
    """
    source = hf_source(directory)
    stored = source.tokenizer()
    config = from_dict({"model": source.model, "parallel": {"pp": 1}})
    model = config.to_dict()["model"]
    source.check(model_def(config).specs)     # names and shapes from the headers: refused before anything is written
    check_vocabulary(stored, config.model.vocab_size, source.describe())   # generate would refuse the import
    out = Path(out)
    what = f"import output {str(out)!r}"
    check_space(out.parent, _import_bytes(source, stored), what)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")

    def write() -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["step"] = 0
            f.attrs["n_layers"] = source.n_layers
            f.attrs["model"] = json.dumps(model, sort_keys=True)
            stored.write(f)
            for index in range(source.n_layers):     # one group in memory at a time
                group = f.create_group(layer_group(index))
                for name, array in source.read([index])[index].items():
                    group.create_dataset(name, data=np.asarray(array, dtype=np.float32), fletcher32=True)
        cf.fsync_path(tmp)

    write_in_child(tmp, write, what)
    with signals_held():
        commit_output(tmp, out, None, "import output")
    return source


def _import_bytes(source: HFSource, stored: Any) -> int:
    """About how many bytes the imported file takes: every tensor in float32, the tokenizer files, HDF5's share."""
    values = sum(math.prod(piece.shape) for index in range(source.n_layers)
                 for piece in group_pieces(source.hf.kind, source.hf.model, index))
    files = sum(len(data) for _, data in stored.files) if stored is not None else 0
    return 4 * values + files + values // 64 + (1 << 20)


def check_new_directory(out: str | Path, fmt: str = "hf") -> None:
    """Raise ConfigError unless out is a new path in an existing, writable directory (export never writes into one)."""
    p = Path(out)
    if not str(out):
        raise ConfigError("export output is empty: name the directory to create")
    if p.exists() or p.is_symlink():
        raise ConfigError(f"export output {str(p)!r} already exists; export --format {fmt} creates a new directory "
                          f"and never writes into an existing one: give a new path")
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"export output directory {str(parent)!r} does not exist (for export output {str(p)!r})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"export output {str(p)!r} is not writable: no write permission on {str(parent)!r}")
    probe = parent / f".{p.name}.probe-{secrets.token_hex(4)}"
    try:    # as root /proc and read-only mounts pass the permission bits (the export then failed with a bare errno)
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise ConfigError(f"export output {str(p)!r}: cannot create a directory in {str(parent)!r}: "
                          f"{exc.strerror or exc}") from None


def _tokenizer_files(stored: Any, label: str) -> dict[str, bytes]:
    """The tokenizer files an export writes (config.json is the export's own)."""
    if stored is None:
        raise ConfigError(f"{label} has no tokenizer, so AutoTokenizer could not load the export: train on data "
                          f"written by examples/text_to_hdf5.py, or import a Hugging Face model")
    if stored.kind != "hf":
        from hpcpipe.hf.simple_tokenizers import tokenizer_files_for
        return tokenizer_files_for(stored.load())
    return {name: data for name, data in stored.files if name != "config.json"}


def _original_context(stored: Any, config: dict[str, Any]) -> dict[str, Any]:
    """{"max_position_embeddings": the original model's context} when the model came from a Hugging Face directory
    (its config.json travels with the tokenizer) with a longer context than the run's model.seq_len, else {}.

    A fine-tuning run on 256-token windows of a 128k-context Llama must not shrink the model's declared
    context: RoPE has no position table, the weights are the same shape at any context. Only a model of the
    original's shape counts (a model trained from scratch with a borrowed tokenizer keeps its own seq_len).
    """
    if stored is None or stored.kind != "hf" or "max_position_embeddings" not in config:
        return {}
    raw = dict(stored.files).get("config.json")
    try:
        original = loads(raw) if raw is not None else None
    except JSONTextError:
        return {}
    if not isinstance(original, dict):
        return {}
    same = all(original.get(key) == config.get(key) for key in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                                "num_attention_heads", "intermediate_size"))
    context = original.get("max_position_embeddings")
    if same and isinstance(context, int) and not isinstance(context, bool) and \
            context > config["max_position_embeddings"]:
        return {"max_position_embeddings": context}
    return {}


def check_hf_exportable(source: WeightsSource) -> None:
    """Raise ConfigError unless the source's model has a Hugging Face form (a GPT or Llama-family decoder)."""
    if source.model_kind not in DECODERS:
        raise ConfigError(f"{source.describe()} holds an MLP; export --format hf writes GPT (gpt2) and Llama-family "
                          f"models")


def export_hf(source: WeightsSource, out: str | Path, dtype: str = "float32") -> None:
    """Write the model of a source (checkpoint, weights file) as a new Hugging Face directory at out."""
    check_hf_exportable(source)
    kind, label = source.model_kind, source.describe()
    from hpcpipe.hf.names import hf_config_dict, hf_state
    from hpcpipe.hf.safetensors import write_sharded
    from hpcpipe.hf.tokenizer import write_tokenizer_dir

    model = from_dict({"model": source.model, "parallel": {"pp": 1}}).model
    keys = {key: getattr(model, key) for key in source.model if hasattr(model, key)}
    keys["rope_scaling"] = dict(model.rope_scaling) or None
    stored = source.tokenizer()
    files = _tokenizer_files(stored, label)
    eos = stored.eos_ids() if stored is not None else ()
    bos = getattr(stored.load(), "bos_id", None) if stored is not None else None
    check_new_directory(out)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")

    def write() -> None:
        tensors = hf_state(kind, keys, source.read(list(range(source.n_layers))))
        check_range(tensors, dtype, label)
        write_sharded(tmp, tensors, SHARD_BYTES, dtype=dtype)
        config = hf_config_dict(kind, keys, dtype, eos, bos)
        config.update(_original_context(stored, config))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if "generation_config.json" not in files:
            generation = {"bos_token_id": bos, "eos_token_id": list(eos) if len(eos) > 1 else (eos[0] if eos else None)}
            files["generation_config.json"] = (json.dumps(generation, indent=2) + "\n").encode()
        write_tokenizer_dir(tmp, files)
        for path in tmp.iterdir():
            cf.fsync_path(path)

    write_in_child(tmp, write, f"export output {str(out)!r}", directory=True)
    with signals_held():
        try:
            os.rename(tmp, out)     # a directory that appeared meanwhile makes this fail: it is left alone
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)    # only what this export created
            raise ConfigError(f"export output {str(out)!r} appeared while the export was writing; it was left "
                              f"alone ({exc.strerror or exc})") from None
