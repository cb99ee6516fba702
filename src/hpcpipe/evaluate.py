"""Held-out evaluation on one process: sequential NumPy forward of stored weights over an HDF5 data file.

    python -m hpcpipe.evaluate --weights checkpoints --data data/digits-test.h5
    python -m hpcpipe.evaluate --weights gpt-checkpoints --data data/text-heldout.h5

Weights are anything :func:`hpcpipe.state.sources.resolve_weights` accepts; the
model (its kind and shape) is the one stored with them. Prints one JSON line.
An MLP gives ``{"n", "accuracy", "cross_entropy", "weights", "step"}`` for
integer labels (cross_entropy = mean softmax cross entropy of the outputs as
logits) or ``{"n", "mse", "weights", "step"}`` for float targets. A GPT
gives ``{"n", "tokens", "loss_nats",
"loss_bits", "weights", "step"}``: the mean cross-entropy per target token
of the token windows (:func:`evaluate_tokens`). Bad input (a file that is not HDF5, a directory,
missing datasets, wrong shapes or dtypes, row counts that differ, NaN/Inf
values, labels or token ids out of range) is one ``hpcpipe: error:``
line naming the file, exit status 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.cli import CommandParser
from hpcpipe.config import DECODERS
from hpcpipe.config_checks import WEIGHT_FORMATS
from hpcpipe.errors import ConfigError
from hpcpipe.h5files import member, open_hdf5
from hpcpipe.kernels.formats import inference_format, kept_values
from hpcpipe.lazy_h5py import h5py
from hpcpipe.nn.core.activations import make_activation
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.registry import KINDS, model_def
from hpcpipe.runtime.host_memory import keep_freed_memory
from hpcpipe.runtime.launcher import launcher_rank, one_process_problem
from hpcpipe.runtime.progress import Progress
from hpcpipe.state.hf_source import is_hf_directory
from hpcpipe.state.kinds import stored_config
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.tokenizer import StoredTokenizer, read_stored
from hpcpipe.state.weights_source import WeightsSource
from hpcpipe.train.tokens import check_token_file


def forward(arrays: dict[int, dict[str, np.ndarray]], model: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """Return the model output for inputs x, layer by layer (float32, as training)."""
    n = len(arrays)
    a = np.asarray(x, dtype=np.float32)
    for i in range(n):
        z = a @ arrays[i]["weight"]
        if "bias" in arrays[i]:
            z = z + arrays[i]["bias"]
        last = i == n - 1
        name = model.get("activation", "relu") if (not last or model.get("final_activation", True)) else "identity"
        a, _ = make_activation(name).forward(np, z)
    return a


CHUNK_ROWS = 65536   # rows evaluated at a time: memory stays bounded whatever the file's size


def _first_bad_row(ok: np.ndarray) -> int:
    """Index of the first row with a False anywhere in it."""
    return int(np.flatnonzero(~ok.reshape(len(ok), -1).all(axis=1))[0])


def check_eval_data(f: h5py.File, label: str, x_name: str, y_name: str, in_dim: int, out_dim: int) -> bool:
    """Check datasets, shapes and dtypes against the weights; return True for integer labels, False for targets."""
    x, y = (member(f, name, label) for name in (x_name, y_name))
    for name, obj in ((x_name, x), (y_name, y)):
        if not isinstance(obj, h5py.Dataset):
            raise ConfigError(f"{label} has no dataset {name!r} (it has: {sorted(f.keys())})")
    if x.ndim != 2 or x.shape[1] != in_dim:
        raise ConfigError(f"dataset {x_name!r} in {label} has shape {x.shape}; the weights take {in_dim} features: "
                          f"(N, {in_dim}) is needed")
    if x.dtype.kind != "f":
        raise ConfigError(f"dataset {x_name!r} in {label} has dtype {x.dtype}; a float dtype is needed")
    n = x.shape[0]
    if n == 0:
        raise ConfigError(f"{label} holds no samples (dataset {x_name!r} has 0 rows)")
    if y.ndim >= 1 and y.shape[0] != n:
        raise ConfigError(f"dataset {y_name!r} in {label} has {y.shape[0]} rows but {x_name!r} has {n}")
    if y.dtype.kind in "iu" and y.shape == (n,):
        return True
    if y.dtype.kind == "f" and y.shape == (n, out_dim):
        return False
    raise ConfigError(f"dataset {y_name!r} in {label} has shape {y.shape} dtype {y.dtype}; the weights give "
                      f"{out_dim} outputs: integer labels of shape ({n},) or float targets of shape ({n}, {out_dim}) "
                      f"are needed")


def read_rows(dset: h5py.Dataset, a: int, b: int, label: str) -> np.ndarray:
    """Return rows a..b-1 of a dataset; ConfigError naming the file, dataset and rows when they cannot be read."""
    try:
        return dset[a:b]
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read rows {a}..{b - 1} of dataset {dset.name.lstrip('/')!r}: {exc}") \
            from None


def evaluate(weights: str | Path, data: str | Path, x_name: str = "x", y_name: str = "y",
             weight_format: str = "auto") -> dict[str, Any]:
    """Return {'n', 'accuracy', 'cross_entropy'} for integer labels or {'n', 'mse'} for float targets (MLP).

    For a GPT or a Llama-family model (hpcpipe weights, a checkpoint or a Hugging Face directory), {'n',
    'tokens', 'loss_nats', 'loss_bits'} (see :func:`evaluate_tokens`), with the weights as ``weight_format``
    keeps them (q8_0: the quantized values; float32 and stored: the stored values).

    The data are checked against the weights first (datasets, shapes, dtypes,
    row counts), then read CHUNK_ROWS at a time; a NaN/Inf input or target, a
    label outside [0, outputs) or a non-finite model output is a ConfigError
    naming the dataset and the first bad row, never a NaN in the result.
    ``cross_entropy`` is the mean softmax cross entropy of the outputs taken
    as logits (as ``train.loss = "cross_entropy"``); ``mse`` the mean over
    every element (as ``train.loss = "mse"``).
    """
    source = resolve_weights(weights, "--weights")
    if source.model_kind in DECODERS:   # a LoRA run's checkpoint: its merged model (forward_only)
        return evaluate_tokens(source.forward_only("float32"), data, x_name, y_name, weight_format)
    arrays = source.read(list(range(source.n_layers)))
    odd = [i for i in (0, source.n_layers - 1) if "weight" not in arrays[i]]
    if odd:     # no model attribute recorded, and not an MLP's layers: e.g. a GPT's written by hand
        raise ConfigError(f"{source.describe()} records no model kind (root attribute 'model') and its layer "
                          f"{odd[0]} holds {sorted(arrays[odd[0]])}, not an MLP's weight: store the model config "
                          f"with the weights (as training and checkpoint export do)")
    in_dim, out_dim = arrays[0]["weight"].shape[0], arrays[source.n_layers - 1]["weight"].shape[1]
    label = f"data file {str(data)!r}"
    with open_hdf5(data, label) as f:
        labels = check_eval_data(f, label, x_name, y_name, in_dim, out_dim)
        x, y = f[x_name], f[y_name]
        n = x.shape[0]
        correct, total = 0, 0.0
        progress = Progress()
        for a in range(0, n, CHUNK_ROWS):
            b = min(a + CHUNK_ROWS, n)
            xs, ys = read_rows(x, a, b, label), read_rows(y, a, b, label)
            for name, rows in ((x_name, xs), (y_name, ys)):
                if rows.dtype.kind == "f" and not np.isfinite(rows).all():
                    r = _first_bad_row(np.isfinite(rows))
                    raise ConfigError(f"dataset {name!r} in {label} holds a non-finite value in row {a + r} "
                                      f"({rows[r].reshape(-1)[~np.isfinite(rows[r].reshape(-1))][0]})")
            if labels and ((ys < 0) | (ys >= out_dim)).any():
                r = int(np.flatnonzero((ys < 0) | (ys >= out_dim))[0])
                raise ConfigError(f"dataset {y_name!r} in {label} holds label {int(ys[r])} in row {a + r}; the "
                                  f"weights give {out_dim} classes: labels must be in [0, {out_dim})")
            out = forward(arrays, source.model, xs).astype(np.float64)
            if not np.isfinite(out).all():
                r = _first_bad_row(np.isfinite(out))
                raise ConfigError(f"the output of {source.describe()} for row {a + r} of {label} is not finite "
                                  f"(non-finite weights, or values beyond float32)")
            if labels:
                correct += int(np.sum(out.argmax(axis=1) == ys))
                shifted = out - out.max(axis=1, keepdims=True)
                total += float(np.sum(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(ys)), ys]))
            else:
                total += float(np.sum((out - ys) ** 2))
            progress.show(f"hpcpipe.evaluate: {b:,}/{n:,} rows", b / n)
        progress.close(f"hpcpipe.evaluate: {n:,} rows")
    result: dict[str, Any] = {"n": int(n)}
    if labels:
        result.update(accuracy=correct / n, cross_entropy=total / n)
    else:
        result["mse"] = total / (n * out_dim)
    result.update(weights=str(source.path), step=source.step)
    return result


# --- GPT and llama: mean cross-entropy per target token over token windows ---------------------------------

SLAB_ELEMENTS = 1 << 21   # numbers in the largest activation of one slab (logits or attention scores)


def slab_rows(shape: Any) -> int:
    """Return how many windows to run at once so that no activation exceeds about SLAB_ELEMENTS numbers."""
    widest = max(shape.vocab, shape.ff, 3 * shape.d_model, shape.n_heads * shape.seq_len)
    return max(1, SLAB_ELEMENTS // (shape.seq_len * widest))


def load_decoder(source: WeightsSource, definition: Any, dtype: str, weight_format: str = "float32") -> Decoder:
    """Return the whole decoder (any kind) holding the stored weights (every group checked, then read), with the
    values ``weight_format`` keeps (q8_0: each matrix quantized, then widened for the float computation)."""
    source.check(definition.specs)
    model = Decoder(definition, np, dtype)
    arrays = source.read(list(range(definition.n_layers)))
    for index in range(definition.n_layers):
        group = arrays.pop(index)
        if weight_format == "q8_0":
            group = {name: kept_values(name, value, "q8_0") for name, value in group.items()}
        model.load_group(index, group)
    return model


def logits_of(model: Decoder, tokens: np.ndarray) -> np.ndarray:
    """Return the (rows, T, vocab) logits, keeping no layer's cache beyond its own step."""
    x: Any = tokens
    for layer in model.layers:
        x, _ = layer.forward(x)
    return x


def token_losses(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Return the cross-entropy of every target token (rows, T): log-sum-exp minus the target's logit."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=-1))
    return lse - np.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]


def _window(data: str | Path, x_name: str, longest: int) -> int:
    """Return the token file's window length when it is at most ``longest`` (the model's context); longer windows
    are refused here, saying so (other shapes are ``longest``: refused later by the file's check)."""
    where = f"token file {str(data)!r}"
    with open_hdf5(data, where) as f:
        x = member(f, x_name, where)
        t = x.shape[1] if isinstance(x, h5py.Dataset) and x.ndim == 2 else 0
    if t > longest:
        raise ConfigError(f"dataset {x_name!r} in {where} holds windows of {t} tokens, longer than the model's "
                          f"context of {longest}: write windows of at most {longest} (python examples/"
                          f"text_to_hdf5.py ... --seq-len {longest})")
    return t if t > 0 else longest


def check_data_tokenizer(data: str | Path, source: WeightsSource) -> None:
    """Refuse a token file written with another tokenizer than the model's (both stored): its ids would mean other
    tokens to the model, and the loss would be a number about nothing (train refuses such data too)."""
    where = f"--data {str(data)!r}"
    with open_hdf5(data, where) as f:
        written = read_stored(f, where)
    own = source.tokenizer()
    if written is None or own is None or _same_tokenizer(written, own):
        return
    what = "another Hugging Face tokenizer" if written.kind == own.kind == "hf" else f"the {written.kind} tokenizer"
    mine = "its own Hugging Face tokenizer" if own.kind == "hf" else f"a {own.kind} tokenizer of its own"
    if own.kind != "hf":
        how = "--tokenizer as the model's data was (the same text for chars)"
    elif is_hf_directory(source.path):
        how = f"--tokenizer {source.path}"
    else:   # a checkpoint or weights file is no --tokenizer: its export is a directory that holds the tokenizer
        how = (f"--tokenizer HF_DIR, after python -m hpcpipe.checkpoint export {source.path} HF_DIR --format hf "
               f"(it writes the model's tokenizer.json)")
    raise ConfigError(f"{where} was tokenized with {what}, but the model ({source.describe()}) has {mine}: the "
                      f"data's token ids would mean other tokens to it; tokenize the text with the model's: "
                      f"python examples/text_to_hdf5.py TEXT {how}")


def _same_tokenizer(a: StoredTokenizer, b: StoredTokenizer) -> bool:
    """Whether two stored tokenizers give the same ids: the same tokenizer.json (hf) or the same spec."""
    if a.kind != b.kind:
        return False
    if a.kind == "hf":
        return dict(a.files).get("tokenizer.json") == dict(b.files).get("tokenizer.json")
    return json.loads(a.attr) == json.loads(b.attr)


def evaluate_tokens(source: WeightsSource, data: str | Path, x_name: str = "x", y_name: str = "y",
                    weight_format: str = "auto") -> dict[str, Any]:
    """Return {'n', 'tokens', 'loss_nats', 'loss_bits', 'weights', 'step'} of a GPT or llama over a token file.

    The token file is checked first (integer ``x`` and ``y`` of shape (N, seq_len),
    every id inside the vocabulary: the first bad one is named by row); then the
    windows run through :class:`hpcpipe.nn.core.decoder_model.Decoder`
    (the layers the pipeline trains) in the model's dtype, in slabs whose largest activation holds about
    ``SLAB_ELEMENTS`` numbers, so memory stays bounded whatever the file's size.

    ``n`` counts windows, ``tokens`` target tokens; ``loss_nats`` is their mean
    cross-entropy and ``loss_bits`` the same in bits (nats / ln 2). A non-finite
    loss is a ConfigError naming the row, never a NaN in the result.
    """
    label = source.describe()
    stored = dict(source.model)
    kind = KINDS.get(stored.get("kind", "mlp"))
    if kind is not None and kind.seq_len_free:    # RoPE has no position table: windows up to the context length work
        stored["seq_len"] = _window(data, x_name, stored["seq_len"])
    config = stored_config(stored, label)
    definition, dtype = model_def(config), config.model.dtype
    shape = definition.shape
    n = check_token_file(data, x_name, y_name, shape.seq_len, shape.vocab)
    check_data_tokenizer(data, source)
    model = load_decoder(source, definition, dtype, inference_format(weight_format))
    where = f"token file {str(data)!r}"
    total, step = 0.0, slab_rows(shape)
    progress = Progress()
    with open_hdf5(data, where) as f:
        x, y = f[x_name], f[y_name]
        for a in range(0, n, step):
            b = min(a + step, n)
            xs = read_rows(x, a, b, where).astype(np.int64)
            ys = read_rows(y, a, b, where).astype(np.int64)
            losses = token_losses(logits_of(model, xs), ys)
            finite = np.isfinite(losses).all(axis=1)
            if not finite.all():
                row = a + int(np.flatnonzero(~finite)[0])
                raise ConfigError(f"the loss of {label} on row {row} of {where} is not finite "
                                  f"(non-finite weights, or values beyond {dtype})")
            total += float(losses.sum(dtype=np.float64))
            progress.show(f"hpcpipe.evaluate: {b:,}/{n:,} windows", b / n)
    progress.close(f"hpcpipe.evaluate: {n:,} windows")
    tokens = n * shape.seq_len
    nats = total / tokens
    return {"n": int(n), "tokens": int(tokens), "loss_nats": nats, "loss_bits": nats / math.log(2),
            "weights": str(source.path), "step": source.step}


EPILOG = """examples:
  python -m hpcpipe.evaluate --weights checkpoints --data data/digits-test.h5
  python -m hpcpipe.evaluate --weights SmolLM2-135M --data text-heldout.h5 --weight-format q8_0

Prints one JSON line (MLP: n, accuracy, cross_entropy or mse; decoder: n, tokens, loss_nats, loss_bits; and
weights, step). exit status: 0 success, 2 bad input (one hpcpipe: error: line naming the file)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.evaluate``; prints one JSON line, returns the exit status."""
    parser = CommandParser(prog="python -m hpcpipe.evaluate", description=__doc__.split("\n")[0], epilog=EPILOG)
    parser.add_argument("--weights", required=True, help="weights file, checkpoint root or step directory, or a "
                                                         "Hugging Face model directory")
    parser.add_argument("--data", required=True, help="HDF5 file with datasets x and y")
    parser.add_argument("--x", default="x", help="input dataset: MLP (N, features) float; a decoder (GPT, "
                                                 "Llama, moe) (N, seq_len) token ids")
    parser.add_argument("--y", default="y", help="MLP integer labels (N,) or float targets (N, outputs); a "
                                                 "decoder (N, seq_len) next-token ids")
    parser.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                        help="how a decoder's weights are kept (model.weight_format): q8_0 measures the quantized "
                             "model; float32 and stored compute with the stored values")
    args = parser.parse_args(argv)
    problem = one_process_problem("hpcpipe.evaluate")
    if problem is not None:
        if launcher_rank() == 0:          # one line, not one per process
            print(f"hpcpipe: error: {problem}", file=sys.stderr)
        return 2
    keep_freed_memory()
    try:
        print(json.dumps(evaluate(args.weights, args.data, args.x, args.y, args.weight_format)))
    except ConfigError as exc:
        print(f"hpcpipe: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # e.g. a file unreadable at the system level: still one line naming it
        print(f"hpcpipe: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
