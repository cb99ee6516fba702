"""hf/tokenizer.py and hf/backend.py with real tokenizers built in the test: encode and decode equal transformers'
AutoTokenizer (byte-level BPE as GPT-2, Llama 3 and Qwen2 use; Llama 2 style Metaspace with byte fallback, as
LlamaTokenizer and as TokenizersBackend), streaming never splits a character, and the files travel in HDF5."""

import json

import numpy as np
import pytest

T = pytest.importorskip("transformers")

from support.hf import SAMPLES, bytelevel_tokenizer, metaspace_tokenizer, save_tokenizer, tiny_config  # noqa: E402

from hpcpipe.errors import ConfigError  # noqa: E402
from hpcpipe.hf.tokenizer import (  # noqa: E402
    HFTokenizer,
    from_files,
    load_tokenizer,
    tokenizer_files,
    write_tokenizer_dir,
)
from hpcpipe.state.tokenizer import read_tokenizer_files, write_tokenizer_group  # noqa: E402

LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPECIAL_TEXT = ["<|begin_of_text|>hello<|eot_id|>", "a<|endoftext|>b", "<|im_start|>user\nhi<|im_end|>\n",
                "<s>[INST] hi [/INST]", "<s>hi</s> <unk>", " <s> x", "<|start_header_id|> x <|end_header_id|>"]
MULTIBYTE = "Grüße 😀 日本語のテキスト — naïve 👩‍💻 ŝ̷ţ̵ 中文 ∑∫√ end"


def _gpt2(d):
    return save_tokenizer(bytelevel_tokenizer(["<|endoftext|>"]), d, bos_token="<|endoftext|>",
                          eos_token="<|endoftext|>")


def _gpt2_class(d):
    save_tokenizer(bytelevel_tokenizer(["<|endoftext|>"]), d, config_extra={"tokenizer_class": "GPT2Tokenizer"})
    tiny_config("gpt2").save_pretrained(str(d))
    return d


def _llama3(d):
    save_tokenizer(bytelevel_tokenizer(LLAMA3, bos="<|begin_of_text|>"), d, bos_token="<|begin_of_text|>",
                   eos_token="<|eot_id|>", config_extra={"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "clean_up_tokenization_spaces": True})
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4], "bos_token_id": 0}))
    return d


def _llama2(d, model_type="llama", **extra):
    save_tokenizer(metaspace_tokenizer(), d, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                   config_extra={"tokenizer_class": "LlamaTokenizerFast", "legacy": False, **extra})
    tiny_config(model_type).save_pretrained(str(d))
    return d


def _qwen2(d):
    save_tokenizer(bytelevel_tokenizer(QWEN), d, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tiny_config("qwen2", eos_token_id=2).save_pretrained(str(d))
    return d


BUILDERS = {"gpt2": _gpt2, "gpt2-class": _gpt2_class, "llama3": _llama3, "llama2": _llama2,
            "llama2-legacy": lambda d: _llama2(d, legacy=True),
            "llama2-bos-eos": lambda d: _llama2(d, add_bos_token=False, add_eos_token=True),
            "mistral": lambda d: _llama2(d, "mistral"), "qwen2": _qwen2}
CLASSES = {"gpt2": "TokenizersBackend", "gpt2-class": "GPT2Tokenizer", "llama3": "TokenizersBackend",
           "llama2": "LlamaTokenizer", "llama2-legacy": "LlamaTokenizer", "llama2-bos-eos": "LlamaTokenizer",
           "mistral": "TokenizersBackend", "qwen2": "Qwen2Tokenizer"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for name, build in BUILDERS.items():
        (root / name).mkdir()
        out[name] = build(root / name)
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
def test_encode_and_decode_equal_autotokenizer(dirs, name):
    auto = T.AutoTokenizer.from_pretrained(str(dirs[name]))
    ours = load_tokenizer(dirs[name])
    assert type(auto).__name__ == ours.backend_class == CLASSES[name]
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.vocab_size == len(auto)
    for text in SAMPLES + SPECIAL_TEXT + [MULTIBYTE]:
        ids = ours.encode(text)
        assert ids.dtype == np.int64 and ids.tolist() == auto(text)["input_ids"], text
        assert ours.decode(ids) == auto.decode(ids.tolist(), skip_special_tokens=True), text
        assert ours.encode(text, add_special_tokens=False).tolist() == auto(text, add_special_tokens=False)[
            "input_ids"]
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, ours.vocab_size, rng.integers(1, 30))
        assert ours.decode(ids) == auto.decode(ids.tolist(), skip_special_tokens=True)


def test_special_ids_and_the_bos_rules(dirs):
    llama3 = load_tokenizer(dirs["llama3"])
    assert llama3.encode("hi")[0] == llama3.bos_id == llama3.token_to_id("<|begin_of_text|>")
    assert llama3.eos_ids == (1, 4) and llama3.eos_token == "<|eot_id|>"
    gpt2 = load_tokenizer(dirs["gpt2"])
    assert gpt2.eos_ids == (gpt2.token_to_id("<|endoftext|>"),) and gpt2.encode("hi")[0] != gpt2.bos_id
    assert load_tokenizer(dirs["qwen2"]).eos_ids == (2,)   # config.json's, no generation_config.json
    # transformers 5 drops add_bos_token / add_eos_token when tokenizer.json exists: its post-processor decides
    assert load_tokenizer(dirs["llama2-bos-eos"]).encode("hi")[0] == 1


def test_add_bos_token_in_the_config_of_a_backend_tokenizer(tmp_path):
    d = save_tokenizer(bytelevel_tokenizer(["<|endoftext|>"]), tmp_path / "t", bos_token="<|endoftext|>",
                       config_extra={"add_bos_token": True, "add_eos_token": True})
    auto, ours = T.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    for text in SAMPLES:
        assert ours.encode(text).tolist() == auto(text)["input_ids"]


def test_legacy_special_tokens_map_and_extra_tokens(tmp_path):
    d = save_tokenizer(metaspace_tokenizer(), tmp_path / "t")
    config = json.loads((d / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "unk_token"):
        config.pop(key, None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
        "eos_token": "</s>", "additional_special_tokens": ["<extra_1>", "<extra_2>"]}))
    auto, ours = T.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    assert ours.special_tokens_map == auto.special_tokens_map and ours.vocab_size == len(auto)
    for text in ["a<extra_1>b <extra_2>", "<s>x</s>"] + SAMPLES[:5]:
        ids = ours.encode(text)
        assert ids.tolist() == auto(text)["input_ids"]
        assert ours.decode(ids) == auto.decode(ids.tolist(), skip_special_tokens=True)


def test_clean_up_spaces_of_a_word_level_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = "hello world , . ! ? don ' t it ' s [UNK]".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = save_tokenizer(tok, tmp_path / "w", unk_token="[UNK]", clean_up_tokenization_spaces=True)
    auto, ours = T.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    ids = ours.encode("hello , world . it ' s don ' t !")
    assert ours.decode(ids) == auto.decode(ids.tolist(), skip_special_tokens=True) == "hello, world. it's don't!"
    stream = ours.incremental_decoder()
    assert "".join(stream.decode([i]) for i in ids) + stream.finish() == ours.decode(ids)


@pytest.mark.parametrize("name", ["gpt2", "llama3", "llama2", "mistral", "qwen2"])
def test_streaming_every_prefix_is_whole_characters(dirs, name):
    ours = load_tokenizer(dirs[name])
    ids = ours.encode(MULTIBYTE).tolist()
    assert any("\ufffd" in ours.decode([i]) for i in ids), "the text must split a character across tokens"
    for n in range(len(ids) + 1):
        stream = ours.incremental_decoder()
        pieces = [stream.decode([i]) for i in ids[:n]]
        assert not any("\ufffd" in p for p in pieces), (n, pieces)
        pieces.append(stream.finish())
        assert "".join(pieces) == stream.text == ours.decode(ids[:n]), n
    stream = ours.incremental_decoder()
    assert stream.decode(ids[:3]) + stream.decode(np.array(ids[3:])) + stream.finish() == ours.decode(ids)


def test_streaming_a_cut_character_ends_as_the_decode_does(dirs):
    ours = load_tokenizer(dirs["gpt2"])
    cut = ours.encode("ab ⛄").tolist()[:-1]   # generation stopped inside the snowman's three bytes
    assert ours.decode(cut).endswith("\ufffd")
    stream = ours.incremental_decoder()
    shown = "".join(stream.decode([i]) for i in cut)
    assert shown == "ab " and stream.finish() == ours.decode(cut)[3:]


def test_streaming_after_a_prompt_keeps_the_leading_space(dirs):
    ours = load_tokenizer(dirs["llama2"])
    prompt, answer = ours.encode("the quick brown"), ours.encode(" fox jumps 😀", add_special_tokens=False)
    assert ours.decode(answer) == "fox jumps 😀"   # alone, the first space is stripped, as transformers does
    stream = ours.incremental_decoder(context=prompt)
    text = "".join(stream.decode([i]) for i in answer) + stream.finish()
    full = ours.decode(np.concatenate([prompt, answer]))
    assert text == full[len(ours.decode(prompt)):] == " fox jumps 😀"


def test_the_interface_of_hpcpipe_tokenizers(dirs):
    ours = load_tokenizer(dirs["gpt2"])
    assert ours.kind == "hf" and json.loads(ours.to_json()) == {"kind": "hf"}
    assert ours.decode(np.array([], np.int64)) == "" and ours.decode(ours.encode("x")) == "x"
    assert ours.decode([10**6]) == ""   # an id beyond the vocabulary is skipped, as transformers does
    with pytest.raises(ValueError, match="str"):
        ours.encode(b"bytes")
    with pytest.raises(ValueError, match="negative"):
        ours.decode([3, -1])
    with pytest.raises(ValueError, match="too large"):
        ours.decode([2**40])
    with pytest.raises(ValueError, match="integer"):
        ours.decode(np.array([1.5]))
    assert ours == load_tokenizer(dirs["gpt2"]) and ours != load_tokenizer(dirs["qwen2"])


def test_files_travel_in_hdf5_and_back_to_a_directory(dirs, tmp_path):
    h5py = pytest.importorskip("h5py")
    files = tokenizer_files(dirs["llama3"])
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert set(tokenizer_files(dirs["qwen2"])) == {"tokenizer.json", "tokenizer_config.json", "config.json"}
    path = tmp_path / "w.h5"
    with h5py.File(path, "w") as f:
        write_tokenizer_group(f, files)
        write_tokenizer_group(f, files)   # replaces
    with h5py.File(path, "r") as f:
        assert json.loads(f.attrs["tokenizer"]) == {"kind": "hf"}
        assert f["tokenizer/tokenizer.json"].dtype == np.uint8
        back = read_tokenizer_files(f)
    assert back == files and from_files(back) == load_tokenizer(dirs["llama3"])
    write_tokenizer_dir(tmp_path / "out", back)
    auto = T.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert from_files(back).encode(MULTIBYTE).tolist() == auto(MULTIBYTE)["input_ids"]
    assert not list((tmp_path / "out").glob(".*"))


def test_hdf5_errors(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "w.h5"
    with h5py.File(path, "w") as f:
        with pytest.raises(ConfigError, match="no /tokenizer group") as info:
            read_tokenizer_files(f)
        assert str(path) in str(info.value)
        f.create_group("tokenizer").create_dataset("tokenizer.json", data=np.zeros(3, np.float32))
        with pytest.raises(ConfigError, match="not a one-dimensional uint8"):
            read_tokenizer_files(f)
        write_tokenizer_group(f, {"tokenizer_config.json": b"{}"})
        with pytest.raises(ConfigError, match="no tokenizer.json"):
            read_tokenizer_files(f)
        with pytest.raises(ValueError, match="plain file name"):
            write_tokenizer_group(f, {"../x": b""})


def test_unreadable_tokenizer_files(tmp_path):
    for data, words in [(b'{"model": {"type": "Nope"}}', ["tokenizer.json", "tokenizers package"]),
                        (b"{not json", ["tokenizer.json"]), (b"\xff", ["tokenizer.json", "UTF-8"])]:
        with pytest.raises(ConfigError) as info:
            HFTokenizer({"tokenizer.json": data}, "weights file 'w.h5'")
        message = str(info.value)
        assert "\n" not in message and "weights file 'w.h5'" in message
        assert all(w in message for w in words), message
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        from_files({"tokenizer_config.json": b"{}"})
    with pytest.raises(ConfigError, match="w.h5': tokenizer_config.json is not valid JSON"):
        from_files({"tokenizer.json": b"{}", "tokenizer_config.json": b"{"}, "weights file 'w.h5'")
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer.json") as info:
        tokenizer_files(tmp_path / "d")
    assert str(tmp_path / "d") in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        tokenizer_files(tmp_path / "nowhere")
