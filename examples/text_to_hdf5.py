"""Turn text files into GPT token data: train and held-out HDF5 files of next-token windows.

    python examples/text_to_hdf5.py INPUT.txt [MORE.txt | DIR ...] --out data --seq-len 64 \\
        --tokenizer bytes|chars|HF_DIR --held-out 0.1 [--seed 0]
    # -> data/text-train.h5, data/text-test.h5

The inputs (files, or directories whose text files are read in name order,
not recursively) are read as UTF-8 and joined into one stream; in a directory,
strfile indexes (``*.dat``), links to a file already read (Debian's
``*.u8``), subdirectories and files that are not UTF-8 text are skipped and
counted. The stream is tokenized (``bytes``: UTF-8 bytes, vocabulary 256;
``chars``: the sorted distinct characters of the whole text; a Hugging Face
model directory: its tokenizer.json, as AutoTokenizer encodes the text without
adding special tokens, the stream being one long document), then split by
contiguous blocks: the held-out set is the stream's last ``--held-out``
fraction of tokens, so no window of one set overlaps the other. Each set is
cut into non-overlapping windows w of T+1 tokens (a leftover shorter than that
is dropped): ``x = w[:-1]``, ``y = w[1:]``, so ``y`` (N, T) holds the
next-token targets of ``x`` (N, T), both int32. The training rows are shuffled
with ``--seed``; the held-out rows stay in text order. Root attributes:
``tokenizer`` (JSON, the same text a GPT weights file stores; for a Hugging Face
tokenizer ``{"kind": "hf"}`` and its files in the group ``/tokenizer``), ``seq_len``,
``source`` (the inputs as given), ``source_files`` (JSON list of files read),
``split``, ``token_start``/``token_stop`` (the set's slice of the stream) and
``seed``.

The summary line reports the held-out unigram entropy of the targets: the loss
of a model that ignores context. The GPT issue's target is a held-out loss of
at most 0.6 x that entropy. Existing output files are kept unless ``--force``.
Bad input (a missing file, no text, too short for one window per set) is one
``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import h5py
import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.state.tokenizer import StoredTokenizer, Tokenizer, chars_tokenizer, from_hf_directory


class InputError(Exception):
    """Bad input: printed as one error line, exit status 2."""


def read_texts(inputs: list[str]) -> tuple[str, list[Path], dict[str, int]]:
    """Return the joined text of inputs, the files read and the count of skipped directory entries by reason."""
    files: list[Path] = []
    skipped: dict[str, int] = {}
    seen: set[Path] = set()
    parts: list[str] = []

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    def take(path: Path, text: str) -> None:
        files.append(path)
        seen.add(path.resolve())
        parts.append(text)

    for arg in inputs:
        p = Path(arg)
        if p.is_dir():
            for entry in sorted(p.iterdir()):
                if entry.is_dir():
                    skip("subdirectories")
                elif entry.suffix == ".dat":
                    skip(".dat indexes")
                elif entry.resolve() in seen:
                    skip("links to a file already read")
                else:
                    text = _text_of(entry)
                    if text is None:
                        skip("files that are not UTF-8 text")
                        continue
                    take(entry, text)
        elif p.is_file():
            text = _text_of(p)
            if text is None:
                raise InputError(f"{arg} is not UTF-8 text")
            take(p, text)
        else:
            raise InputError(f"{arg} does not exist")
    if not files:
        raise InputError(f"no text file found in {', '.join(inputs)}")
    # files are joined on a line break so one file's last line does not run into the next file's first
    text = "".join(t if t.endswith("\n") or i == len(parts) - 1 else t + "\n" for i, t in enumerate(parts))
    if not text:
        raise InputError(f"no text in {', '.join(inputs)} (the files are empty)")
    return text, files, skipped


def _text_of(path: Path) -> str | None:
    """Return path's content decoded as UTF-8, or None if it is not UTF-8 text (undecodable, or holds NUL)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut ids into non-overlapping windows of seq_len + 1 tokens; return (x, y) = (w[:, :-1], w[:, 1:])."""
    n = len(ids) // (seq_len + 1)
    w = ids[: n * (seq_len + 1)].reshape(n, seq_len + 1)
    return w[:, :-1], w[:, 1:]


def unigram_entropy(ids: np.ndarray, vocab_size: int) -> float:
    """Return the entropy in nats of the token frequencies of ids."""
    counts = np.bincount(ids.reshape(-1), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def write(path: Path, x: np.ndarray, y: np.ndarray, attrs: dict, stored: StoredTokenizer) -> None:
    """Write one token file (x, y int32, checksummed) under a temporary name, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("x", data=x.astype(np.int32), fletcher32=True, chunks=True)
            f.create_dataset("y", data=y.astype(np.int32), fletcher32=True, chunks=True)
            stored.write(f)
            for key, value in attrs.items():
                f.attrs[key] = value
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def convert(args: argparse.Namespace) -> str:
    """Read, tokenize, split and write; return the summary line."""
    if args.seq_len < 1:
        raise InputError(f"--seq-len must be at least 1, got {args.seq_len}")
    if not 0 < args.held_out < 1:
        raise InputError(f"--held-out must be a fraction strictly between 0 and 1, got {args.held_out}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} is a file, not a directory: --out names the directory that gets "
                         f"text-train.h5 and text-test.h5")
    targets = [out / "text-train.h5", out / "text-test.h5"]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not args.force:
        raise InputError(f"{', '.join(existing)} already exist(s); remove or pass --force to replace")
    stored = None
    if args.tokenizer not in ("bytes", "chars"):     # before reading the text: a wrong directory is said at once
        try:
            stored = from_hf_directory(args.tokenizer)
        except ConfigError as exc:
            raise InputError(f"--tokenizer {args.tokenizer!r}: {exc}") from None
    text, files, skipped = read_texts(args.inputs)
    skips = "; skipped " + ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) if skipped else ""
    print(f"read {len(files)} file(s), {len(text)} characters{skips}")
    if args.tokenizer in ("bytes", "chars"):
        tok = Tokenizer("bytes") if args.tokenizer == "bytes" else chars_tokenizer(text)
        stored, ids = StoredTokenizer(tok.to_json()), tok.encode(text)
    else:
        tok = stored.load()
        ids = tok.encode(text, add_special_tokens=False)
    cut = len(ids) - round(len(ids) * args.held_out)
    (x_train, y_train), (x_test, y_test) = windows(ids[:cut], args.seq_len), windows(ids[cut:], args.seq_len)
    if len(x_train) == 0 or len(x_test) == 0:
        raise InputError(f"the text is too short: {len(ids)} tokens give {len(x_train)} training and {len(x_test)} "
                         f"held-out windows of --seq-len + 1 = {args.seq_len + 1} tokens; each set needs one")
    order = np.random.default_rng(args.seed).permutation(len(x_train))
    x_train, y_train = x_train[order], y_train[order]
    out.mkdir(parents=True, exist_ok=True)
    common = {"seq_len": args.seq_len, "source": ", ".join(args.inputs),
              "source_files": json.dumps([str(f) for f in files]), "seed": args.seed}
    write(targets[0], x_train, y_train, {**common, "split": "train", "token_start": 0, "token_stop": cut}, stored)
    write(targets[1], x_test, y_test, {**common, "split": "held-out", "token_start": cut, "token_stop": len(ids)},
          stored)
    h = unigram_entropy(y_test, tok.vocab_size)
    return (f"wrote {targets[0]} and {targets[1]}: {len(ids)} tokens ({tok.kind}, vocab {tok.vocab_size}), "
            f"T={args.seq_len}, windows train {len(x_train)} / held-out {len(x_test)}; held-out unigram entropy "
            f"{h:.4f} nats = {h / math.log(2):.4f} bits per token (target: held-out loss <= 0.6 x that = "
            f"{0.6 * h:.4f} nats)")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and convert; bad input is one error line and exit status 2."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or directories of text files")
    parser.add_argument("--out", default="data", help="output directory (default: data)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window T (default: 64)")
    parser.add_argument("--tokenizer", default="bytes", metavar="bytes|chars|HF_DIR",
                        help="bytes (default), chars, or a Hugging Face model directory whose tokenizer.json to use")
    parser.add_argument("--held-out", type=float, default=0.1, help="held-out fraction, the text's tail (0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training rows' order (default: 0)")
    parser.add_argument("--force", action="store_true", help="replace existing output files")
    args = parser.parse_args(argv)
    try:
        print(convert(args))
    except (InputError, ValueError, OSError) as exc:
        print(f"text_to_hdf5: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
