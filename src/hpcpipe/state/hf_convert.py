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
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcpipe.config import DECODERS, from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.hf_source import HFSource, hf_source
from hpcpipe.state.outputs import commit_output
from hpcpipe.state.weights import FORMAT, FORMAT_VERSION, layer_group
from hpcpipe.state.weights_source import WeightsSource

SHARD_BYTES = 5 * 1024 ** 3       # transformers' default max_shard_size


def import_hf(directory: str | Path, out: str | Path) -> HFSource:
    """Write a Hugging Face model directory as one hpcpipe weights file; return the HFSource it read."""
    source = hf_source(directory)
    stored = source.tokenizer()
    model = from_dict({"model": source.model, "parallel": {"pp": 1}}).to_dict()["model"]
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    try:
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit_output(tmp, out, None, "import output")
    return source


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


def _tokenizer_files(stored: Any, label: str) -> dict[str, bytes]:
    """The tokenizer files an export writes (config.json is the export's own)."""
    if stored is None:
        raise ConfigError(f"{label} has no tokenizer, so AutoTokenizer could not load the export: train on data "
                          f"written by examples/text_to_hdf5.py, or import a Hugging Face model")
    if stored.kind != "hf":
        from hpcpipe.hf.simple_tokenizers import tokenizer_files_for
        return tokenizer_files_for(stored.load())
    return {name: data for name, data in stored.files if name != "config.json"}


def export_hf(source: WeightsSource, out: str | Path, dtype: str = "float32") -> None:
    """Write the model of a source (checkpoint, weights file) as a new Hugging Face directory at out."""
    kind = source.model_kind
    label = source.describe()
    if kind not in DECODERS:
        raise ConfigError(f"{label} holds an MLP; export --format hf writes GPT (gpt2) and Llama-family models")
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
    try:
        tmp.mkdir()
        tensors = hf_state(kind, keys, source.read(list(range(source.n_layers))))
        write_sharded(tmp, tensors, SHARD_BYTES, dtype=dtype)
        config = hf_config_dict(kind, keys, dtype, eos, bos)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if "generation_config.json" not in files:
            generation = {"bos_token_id": bos, "eos_token_id": list(eos) if len(eos) > 1 else (eos[0] if eos else None)}
            files["generation_config.json"] = (json.dumps(generation, indent=2) + "\n").encode()
        write_tokenizer_dir(tmp, files)
        for path in tmp.iterdir():
            cf.fsync_path(path)
        os.rename(tmp, out)     # a directory that appeared meanwhile makes this fail: it is left alone
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)    # only what this export created
        raise
