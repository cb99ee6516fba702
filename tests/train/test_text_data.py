"""GPT text data: the tokenizer (bytes / chars) and its JSON, the token file check, examples/text_to_hdf5.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from support import ROOT
from support.launch import one_error

from hpcpipe.errors import ConfigError
from hpcpipe.state.tokenizer import Tokenizer, chars_tokenizer
from hpcpipe.train import tokens
from hpcpipe.train.tokens import check_token_file

EXAMPLE = ROOT / "examples" / "text_to_hdf5.py"
TEXT = "Grüße aus Köln — naïve café ☕ 😀\nThe quick brown fox jumps over the lazy dog.\n" * 3


# --- tokenizer ---------------------------------------------------------------------------------------------------

def test_bytes_round_trip_of_multibyte_utf8():
    tok = Tokenizer("bytes")
    ids = tok.encode(TEXT)
    assert tok.vocab_size == 256 and ids.dtype == np.int64
    assert ids.tolist() == list(TEXT.encode("utf-8")) and len(ids) > len(TEXT)   # multi-byte characters
    assert tok.decode(ids) == TEXT


def test_bytes_decode_of_invalid_utf8_replaces_instead_of_crashing():
    tok = Tokenizer("bytes")
    assert tok.decode([0x41, 0xFF, 0xE2, 0x82, 0x42]) == "A\ufffd\ufffdB"    # a stray byte and a cut sequence


def test_chars_round_trip_and_ids_follow_the_vocabulary_order():
    tok = chars_tokenizer(TEXT)
    assert tok.chars == "".join(sorted(set(TEXT))) and tok.vocab_size == len(set(TEXT))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    fixed = Tokenizer("chars", "zaé")                  # not sorted: ids are positions in chars
    assert fixed.encode("aéz").tolist() == [1, 2, 0]


def test_chars_encode_names_an_unknown_character_and_its_position():
    tok = Tokenizer("chars", "abc ")
    with pytest.raises(ValueError, match=r"character 'x' \(U\+0078\) at position 5 is not in the tokenizer's 4 chars"):
        tok.encode("abc axb")


@pytest.mark.parametrize("tok", [Tokenizer("bytes"), Tokenizer("chars", "ab"), chars_tokenizer(TEXT)])
def test_decode_refuses_ids_outside_the_vocabulary(tok):
    with pytest.raises(ValueError, match=rf"id {tok.vocab_size} at position 1 is outside the vocabulary"):
        tok.decode([0, tok.vocab_size])
    with pytest.raises(ValueError, match="id -1 at position 0"):
        tok.decode([-1])


@pytest.mark.parametrize("tok", [Tokenizer("bytes"), chars_tokenizer(TEXT)])
def test_json_round_trip_matches_the_contract(tok):
    text = tok.to_json()
    doc = json.loads(text)
    assert doc == ({"kind": "bytes"} if tok.kind == "bytes" else {"kind": "chars", "chars": tok.chars})
    assert Tokenizer.from_json(text) == tok
    assert Tokenizer.from_json(text.encode("utf-8")) == tok     # h5py may hand back bytes


@pytest.mark.parametrize("text, message", [
    ('{"kind": "bpe"}', r"unknown kind 'bpe'; expected one of \['bytes', 'chars'\]"),
    ('{"chars": "ab"}', "unknown kind None"),
    ('{"kind": "chars", "chars": "abca"}', r"\"chars\" repeats 'a' \(positions 0 and 3\)"),
    ('{"kind": "chars", "chars": ""}', r"\"chars\" is empty"),
    ('{"kind": "chars", "chars": ["a", "b"]}', r"\"chars\" must be a string, got list"),
    ('{"kind": "chars"}', "kind 'chars' needs a \"chars\" string"),
    ('{"kind": "bytes", "chars": "ab"}', r"kind 'bytes' does not take key\(s\) \['chars'\]"),
    ('["bytes"]', "must be a JSON object"),
    ("{kind: bytes}", "is not valid JSON"),
    (7, "must be JSON text, got int"),
])
def test_from_json_refuses_bad_attributes_with_one_clear_message(text, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_json(text)


def test_chars_tokenizer_of_empty_text_is_refused():
    with pytest.raises(ValueError, match="non-empty text"):
        chars_tokenizer("")


# --- check_token_file ----------------------------------------------------------------------------------------------

def _token_file(path, x, y=None, **extra):
    with h5py.File(path, "w") as f:
        if x is not None:
            f["x"] = x
        if y is not None:
            f["y"] = y
        for name, value in extra.items():
            f[name] = value
    return str(path)


def _good(n=5, t=8, vocab=10, dtype=np.int32):
    ids = np.arange(n * (t + 1)).reshape(n, t + 1) % vocab
    return ids[:, :-1].astype(dtype), ids[:, 1:].astype(dtype)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint16])
def test_good_token_file_returns_its_row_count(tmp_path, dtype):
    assert check_token_file(_token_file(tmp_path / "t.h5", *_good(dtype=dtype)), "x", "y", 8, 10) == 5


def test_out_of_range_id_names_file_dataset_row_column_and_value(tmp_path):
    x, y = _good()
    x[3, 6] = 10
    path = _token_file(tmp_path / "t.h5", x, y)
    with pytest.raises(ConfigError) as err:
        check_token_file(path, "x", "y", 8, 10)
    assert str(err.value) == (f"token file {path!r}: dataset 'x' row 3 column 6 holds token id 10, outside the "
                              f"vocabulary [0, 10) (the first bad id in the file)")


def test_negative_id_in_y_is_refused(tmp_path):
    x, y = _good()
    y[1, 0] = -1
    with pytest.raises(ConfigError, match="dataset 'y' row 1 column 0 holds token id -1, outside the vocabulary"):
        check_token_file(_token_file(tmp_path / "t.h5", x, y), "x", "y", 8, 10)


def test_the_first_bad_row_is_found_across_slabs_and_datasets(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "SLAB_ELEMENTS", 16)     # 2 rows of 8 per slab: the file is read in 50 slabs
    x, y = _good(n=100)
    x[77, 2] = 99
    y[75, 7] = 12            # an earlier row in y wins over a later row in x
    x[90, 0] = -5
    with pytest.raises(ConfigError, match="dataset 'y' row 75 column 7 holds token id 12"):
        check_token_file(_token_file(tmp_path / "t.h5", x, y), "x", "y", 8, 10)


def test_width_other_than_seq_len_is_refused(tmp_path):
    path = _token_file(tmp_path / "t.h5", *_good(t=8))
    with pytest.raises(ConfigError, match=r"dataset 'x' in token file .* has shape \(5, 8\); expected \(N, 16\) "
                                          r"\(N windows of model.seq_len = 16 tokens\)"):
        check_token_file(path, "x", "y", 16, 10)


def test_y_width_other_than_seq_len_is_refused(tmp_path):
    x, y = _good(t=8)
    with pytest.raises(ConfigError, match=r"dataset 'y' .* has shape \(5, 7\); expected \(N, 8\)"):
        check_token_file(_token_file(tmp_path / "t.h5", x, y[:, :7]), "x", "y", 8, 10)


def test_one_dimensional_labels_are_refused(tmp_path):
    x, _ = _good()
    with pytest.raises(ConfigError, match=r"dataset 'y' .* has shape \(5,\); expected \(N, 8\)"):
        check_token_file(_token_file(tmp_path / "t.h5", x, np.zeros(5, np.int64)), "x", "y", 8, 10)


@pytest.mark.parametrize("dtype", [np.float32, np.bool_])
def test_non_integer_dtype_is_refused(tmp_path, dtype):
    x, y = _good()
    with pytest.raises(ConfigError, match=f"dataset 'x' in token file .* has dtype {np.dtype(dtype)}; "
                                          f"token ids must be integers"):
        check_token_file(_token_file(tmp_path / "t.h5", x.astype(dtype), y), "x", "y", 8, 10)


def test_x_and_y_row_counts_must_match(tmp_path):
    x, y = _good()
    with pytest.raises(ConfigError, match="dataset 'x' has 5 rows but 'y' has 4; each input row needs its row"):
        check_token_file(_token_file(tmp_path / "t.h5", x, y[:4]), "x", "y", 8, 10)


def test_missing_dataset_lists_what_the_file_holds(tmp_path):
    x, _ = _good()
    path = _token_file(tmp_path / "t.h5", x, None, targets=x)
    with pytest.raises(ConfigError, match=r"token file .* has no dataset 'y' \(it has: \['targets', 'x'\]\)"):
        check_token_file(path, "x", "y", 8, 10)


def test_empty_token_file_is_refused(tmp_path):
    empty = np.zeros((0, 8), np.int64)
    with pytest.raises(ConfigError, match="holds no token windows"):
        check_token_file(_token_file(tmp_path / "t.h5", empty, empty), "x", "y", 8, 10)


def test_missing_and_non_hdf5_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"token file '.*nope.h5' does not exist"):
        check_token_file(tmp_path / "nope.h5", "x", "y", 8, 10)
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(ConfigError, match=r"token file '.*text.h5' is not a readable HDF5 file"):
        check_token_file(tmp_path / "text.h5", "x", "y", 8, 10)


# --- examples/text_to_hdf5.py --------------------------------------------------------------------------------------

def _run(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(EXAMPLE), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)


def _read(path):
    with h5py.File(path, "r") as f:
        return f["x"][()], f["y"][()], dict(f.attrs)


@pytest.mark.parametrize("kind", ["bytes", "chars"])
def test_example_writes_shifted_windows_with_a_tail_held_out(tmp_path, kind):
    src = tmp_path / "in.txt"
    src.write_text(TEXT * 4, encoding="utf-8")
    t, seed = 16, 3
    proc = _run(src, "--out", tmp_path / "data", "--seq-len", t, "--tokenizer", kind, "--held-out", 0.25,
                "--seed", seed)
    assert proc.returncode == 0, proc.stderr
    x_tr, y_tr, a_tr = _read(tmp_path / "data" / "text-train.h5")
    x_te, y_te, a_te = _read(tmp_path / "data" / "text-test.h5")
    tok = Tokenizer.from_json(a_tr["tokenizer"])
    assert tok.kind == kind and a_te["tokenizer"] == a_tr["tokenizer"]
    stream = tok.encode(TEXT * 4)
    cut = len(stream) - round(0.25 * len(stream))
    assert (a_tr["token_start"], a_tr["token_stop"], a_te["token_start"], a_te["token_stop"]) == \
        (0, cut, cut, len(stream))
    assert a_tr["seq_len"] == t and a_tr["source"] == str(src) and json.loads(a_tr["source_files"]) == [str(src)]
    for x, y in ((x_tr, y_tr), (x_te, y_te)):
        assert x.ndim == 2 and x.shape[1] == t and y.shape == x.shape and np.issubdtype(x.dtype, np.integer)
        assert np.array_equal(x[:, 1:], y[:, :-1])            # y is x shifted by one token
    # held-out rows: the tail of the stream in text order, non-overlapping T+1 windows
    tail = stream[cut:]
    for i in range(len(x_te)):
        w = tail[i * (t + 1):(i + 1) * (t + 1)]
        assert np.array_equal(x_te[i], w[:-1]) and np.array_equal(y_te[i], w[1:])
    assert len(x_te) == len(tail) // (t + 1)
    # training rows: the head's windows in the seeded order; the stored tokenizer decodes them back to the text
    n = cut // (t + 1)
    order = np.random.default_rng(seed).permutation(n)
    head = np.empty((n, t + 1), np.int64)
    head[order] = np.concatenate([x_tr, y_tr[:, -1:]], axis=1)
    assert tok.decode(head.reshape(-1)) == tok.decode(stream[:n * (t + 1)])
    if kind == "chars":
        assert tok.decode(head.reshape(-1)) == (TEXT * 4)[:n * (t + 1)]
    assert f"windows train {n} / held-out {len(x_te)}" in proc.stdout
    counts = np.bincount(y_te.reshape(-1))
    p = counts[counts > 0] / counts.sum()
    assert f"held-out unigram entropy {-(p * np.log(p)).sum():.4f} nats" in proc.stdout
    assert check_token_file(tmp_path / "data" / "text-test.h5", "x", "y", t, tok.vocab_size) == len(x_te)


def test_example_reads_a_directory_like_debian_fortunes(tmp_path):
    d = tmp_path / "fortunes"
    d.mkdir()
    (d / "b").write_text("second file\n%\n" * 20)
    (d / "a").write_text("first file, no final newline\n%\nend")
    (d / "a.dat").write_bytes(b"\x00\x00\x00\x02strfile index")
    (d / "a.u8").symlink_to("a")
    (d / "blob").write_bytes(b"\x00\x01binary")
    (d / "off").mkdir()
    proc = _run(d, "--out", tmp_path / "data", "--seq-len", 8, "--tokenizer", "chars")
    assert proc.returncode == 0, proc.stderr
    joined = (d / "a").read_text() + "\n" + (d / "b").read_text()     # a file without a final newline gets one
    assert proc.stdout.splitlines()[0] == (f"read 2 file(s), {len(joined)} characters; skipped 1 .dat indexes, 1 files "
                                           f"that are not UTF-8 text, 1 links to a file already read, 1 subdirectories")
    _, _, attrs = _read(tmp_path / "data" / "text-train.h5")
    assert json.loads(attrs["source_files"]) == [str(d / "a"), str(d / "b")]
    assert Tokenizer.from_json(attrs["tokenizer"]) == chars_tokenizer(joined)
    x_te, y_te, a_te = _read(tmp_path / "data" / "text-test.h5")
    tail = joined[a_te["token_start"]:]                                 # chars: one token per character
    assert Tokenizer.from_json(a_te["tokenizer"]).decode(x_te[0]) == tail[:8]


def _refused(proc, *words):
    """The example's own refusal: one line `text_to_hdf5: error: ...` holding every one of words, exit 2."""
    one_error(proc, *words, prefix="text_to_hdf5: error: ", alone=True)


def test_example_bad_inputs_are_one_error_line_exit_2_and_no_output(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny text")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    out = tmp_path / "data"
    _refused(_run(tmp_path / "missing.txt", "--out", out), "missing.txt does not exist")
    _refused(_run(empty, "--out", out), "no text in", "empty.txt")
    _refused(_run(binary, "--out", out), "bin.txt is not UTF-8 text")
    _refused(_run(short, "--out", out, "--seq-len", 8), "too short: 9 tokens give 0 training and 0 held-out "
               "windows of --seq-len + 1 = 9 tokens")
    _refused(_run(short, "--out", out, "--held-out", 1.5), "--held-out must be a fraction strictly between 0 and 1")
    _refused(_run(short, "--out", out, "--seq-len", 0), "--seq-len must be at least 1")
    assert not out.exists()
    _refused(_run(short, "--out", short), f"--out {str(short)!r} is a file, not a directory")   # was: [Errno 17]
    assert short.read_text() == "tiny text"
    proc = _run(short, "--out", out, "--tokenizer", tmp_path / "no-model")
    _refused(proc, f"--tokenizer {str(tmp_path / 'no-model')!r}", "does not exist")
    assert "read 1 file(s)" not in proc.stdout           # said before the text is read


def test_example_keeps_existing_output_unless_forced(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(TEXT * 4)
    out = tmp_path / "data"
    out.mkdir()
    (out / "text-test.h5").write_text("mine")
    _refused(_run(src, "--out", out, "--seq-len", 8), "text-test.h5 already exist(s); remove or pass --force")
    assert (out / "text-test.h5").read_text() == "mine" and not (out / "text-train.h5").exists()
    assert _run(src, "--out", out, "--seq-len", 8, "--force").returncode == 0
    assert _read(out / "text-test.h5")[0].shape[1] == 8
    assert sorted(p.name for p in out.iterdir()) == ["text-test.h5", "text-train.h5"]    # no temporary left
