"""A model mixing sliding-window and full-attention blocks (Qwen2's use_sliding_window with max_window_layers, or
layer_types) keeps its windowed blocks' keys in a ring of a few KV blocks per sequence (hpcpipe.nn.core.kv_pages
.ring_layout) while its full blocks keep the whole context: logits past the window as transformers computes them
(NumPy and compiled stages, prompt chunks as the ring's room allows), the rings' bytes bounded by the window and
counted by the memory check; greedy text through `generate` and the openai client equal to transformers' at pp=1
and pp=2; a pool too small for the full blocks refused with one line."""

from __future__ import annotations

import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server, generate

from hpcpipe.kernels import cpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW, PAGE, CONTEXT = 16, 16, 128
RING = 3           # kv_pages.held_pages(128, 16, 16): the window's block, the one before it, the block a token opens
CASES = {          # layers 1 and 2 windowed, layer 0 full; layers 0 and 2 windowed, layer 1 full
    "qwen2-max-window-layers": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen2-layer-types": {"use_sliding_window": True, "sliding_window": WINDOW,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    out = {}
    for name, overrides in CASES.items():
        model = tiny_model("qwen2", vocab_size=tok.get_vocab_size(), num_hidden_layers=3,
                           max_position_embeddings=CONTEXT, tie_word_embeddings=False, **overrides)
        directory = save_model(model, root / name)
        save_tokenizer(tok, directory)
        out[name] = (directory, model)
    return out


def _ring_logits(directory, tokens, compiled, slots=2):
    """Logits at every position of one sequence (slot 1 of ``slots``) through a whole-model DecodeStage whose
    windowed blocks keep rings of RING blocks, its table and chunks kept by the serving ledger (prompt chunks as
    large as the ring's room, then one token a step); also the stage, the largest chunk and the window."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.core.kv_pages import mixed_window
    from hpcpipe.nn.registry import model_def
    from hpcpipe.serve.broker import Request
    from hpcpipe.serve.kv_ledger import KVLedger
    from hpcpipe.serve.sampling import SamplingParams
    from hpcpipe.serve.scheduler import Sequence
    from hpcpipe.state.sources import resolve_weights

    source = resolve_weights(directory).forward_only("float32")
    model = model_def(from_dict({"model": source.model, "parallel": {"pp": 1}}))
    window = mixed_window(model)
    whole = CONTEXT // PAGE
    stage = DecodeStage(model, range(model.n_layers), source.read(list(range(model.n_layers))), np, "float32", slots,
                        compiled=compiled, kv_block=PAGE, kv_blocks=slots * whole, kv_ring=RING)
    ledger = KVLedger(slots * whole, PAGE, CONTEXT, prefix_cache=True, ring=window)
    prompt = 70
    seq = Sequence(Request("w", list(tokens[:prompt]), len(tokens) - prompt, SamplingParams(), 0.0), 1, 0,
                   list(tokens[:prompt]))
    assert ledger.admit(seq)
    out, chunk = [], 0
    while seq.cached < len(tokens):
        end = min(len(tokens), ledger.room(seq), prompt if seq.cached < prompt else seq.cached + 1)
        update = ledger.grow(seq, end)
        if seq.cached == 0:                         # its whole table the first time, as the scheduler sends it
            update = ledger.first_table(seq)
        if update is not None:
            stage.set_pages(*update)
        n = end - seq.cached
        chunk = max(chunk, n)
        out.append(stage.forward(tokens[seq.cached:end], [Segment(1, seq.cached, n)], rows=list(range(n))))
        seq.cached = end
        ledger.trim(seq)
    return np.concatenate(out), stage, chunk, window


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_windowed_blocks_in_rings_give_transformers_logits(models, name, compiled):
    if compiled and cpu.library() is None:
        pytest.skip("the compiled kernels are not built")
    directory, model = models[name]
    tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, 100)
    with torch.no_grad():
        want = model(torch.tensor(tokens[None])).logits.numpy()[0]
    got, stage, chunk, window = _ring_logits(directory, tokens, compiled)
    assert window == WINDOW and got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the 70-token prompt went in chunks no longer than the ring's room (48 positions, then 80 - 48)
    assert chunk == RING * PAGE
    # two windowed blocks: 2 slots x RING blocks of 16 positions each, whatever the context; the full block keeps
    # its pool of 2 whole contexts
    kv, dh = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    position = 2 * kv * dh * 4                                     # one position's key and value, float32
    assert stage.ring_bytes == 2 * 2 * RING * PAGE * position
    assert stage.cache_bytes == stage.ring_bytes + 1 * 2 * CONTEXT * position
    assert stage.ring_bytes // (2 * 2) <= (WINDOW + 2 * PAGE) * position       # per sequence and windowed block


def test_the_memory_check_counts_the_rings():
    from hpcpipe.config import load_config
    from hpcpipe.nn.memory import decode_rank_bytes, ring_pages, ring_window
    from hpcpipe.nn.registry import model_def

    keys = {"kind": "llama", "vocab_size": 64, "seq_len": 1024, "d_model": 16, "n_heads": 2, "n_blocks": 4,
            "sliding_window": 16, "sliding_layers": [1, 2, 3]}
    sets = [f"model.{k}={v!r}".replace("'", '"') for k, v in keys.items()] + ["serve.prefill_tokens=0", "parallel.pp=1"]
    config = load_config(None, sets)
    model = model_def(config)
    assert ring_window(config, model) == 16 and ring_pages(config, model) == RING
    # a full block: max_sequences contexts of 1024 / 16 blocks; a windowed one: max_sequences rings of 3
    full = load_config(None, sets[:-4] + sets[-2:])
    whole = [range(0, 6)]
    assert decode_rank_bytes(full, whole)[1] * (64 + 3 * RING) == decode_rank_bytes(config, whole)[1] * 4 * 64
    # prompt-lookup speculation writes 4 tokens past the next one, a prompt chunk of 64 (serve.prefill_tokens)
    # 64, and pp of them may be in flight: a ring holds them too, so chunks are not cut shorter; no cache, no
    # rings
    spec = load_config(None, [*sets, 'serve.speculate="ngram"', "serve.speculate_tokens=4"])
    assert ring_pages(spec, model) == 4
    assert ring_pages(load_config(None, [*sets, "serve.prefill_tokens=64"]), model) == 7
    assert ring_pages(load_config(None, [*sets, "serve.prefill_tokens=64", "parallel.pp=2"]), model) == 11
    assert ring_pages(load_config(None, [*sets, "serve.kv_cache=false"]), model) == 0


def _greedy(model, directory, ids, new=40):
    fast = transformers.AutoTokenizer.from_pretrained(str(directory))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return fast.decode(out[0][len(ids):], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,tp,kernels", [("qwen2-max-window-layers", 1, 1, "compiled"),
                                                ("qwen2-max-window-layers", 1, 1, "numpy"),
                                                ("qwen2-max-window-layers", 2, 1, "compiled"),
                                                ("qwen2-max-window-layers", 1, 2, "compiled"),
                                                ("qwen2-layer-types", 2, 1, "numpy")])
def test_a_mixed_model_serves_transformers_text_from_rings(models, name, pp, tp, kernels):
    from hpcpipe.serve.setup import prepare

    directory, model = models[name]
    ids = [int(i) for i in np.random.default_rng(2).integers(5, 250, 60)]      # 60 + 40 tokens: a ring holds 48
    want = _greedy(model, directory, ids)
    # prompts not cut in chunks of serve.prefill_tokens: rings of the window's blocks, chunks cut at their room
    sets = [f"parallel.pp={pp}", f"parallel.tp={tp}", "serve.prefill_tokens=0"]
    setup = prepare(directory, pp * tp, None, sets)
    assert setup.ring_window == WINDOW and setup.kv_ring == RING
    env = {"HPCPIPE_KERNELS": kernels}
    with Server(pp * tp, directory, *[a for s in sets for a in ("--set", s)], env=env) as server:
        for _ in range(2):        # the second request reuses the slot: its rings start from zero again
            got = server.client().completions.create(model=directory.name, prompt=ids, max_tokens=40, temperature=0)
            assert got.choices[0].text == want
    # speculation writes 4 tokens past the next one, pp prompt chunks of 8 / pp: rings of 4 blocks; prompt lookup,
    # and the model as its own draft (the draft's stage keeps whole contexts: its catch-up writes a whole prompt)
    if kernels == "numpy":
        for how in ('serve.speculate="ngram"', f'serve.speculate="draft"|serve.draft="{directory}"'):
            sets = [f"parallel.pp={pp}", *how.split("|"), f"serve.prefill_tokens={8 // pp}"]
            assert prepare(directory, pp, None, sets).kv_ring == RING + 1
            with Server(pp, directory, *[a for s in sets for a in ("--set", s)], env=env) as server:
                got = server.client().completions.create(model=directory.name, prompt=ids, max_tokens=40,
                                                         temperature=0)
                assert got.choices[0].text == want


@pytest.mark.slow
def test_generate_runs_a_mixed_model_from_rings_at_pp2(models, tmp_path):
    from hpcpipe.serve.setup import prepare

    directory, model = models["qwen2-layer-types"]
    fast = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt = fast.decode([int(i) for i in np.random.default_rng(4).integers(5, 250, 40)])
    ids = fast(prompt)["input_ids"]
    assert WINDOW < len(ids) <= CONTEXT - 40
    assert prepare(directory, 2, None, ["parallel.pp=2", "serve.prefill_tokens=0"]).kv_ring == RING
    proc, result = generate(tmp_path, 2, directory, prompt, "--set", "parallel.pp=2", "--temperature", "0",
                            "--max-new-tokens", "40", "--set", "serve.prefill_tokens=0")
    assert proc.returncode == 0, proc.stderr
    assert result["completion"] == _greedy(model, directory, ids), result


@pytest.mark.slow
def test_a_pool_short_of_the_full_blocks_context_is_one_line_and_exit_2(models):
    import subprocess

    from support import ROOT
    from support.launch import command

    directory, _ = models["qwen2-max-window-layers"]
    # with 64-token prompt chunks a ring (7 blocks) is shorter than the 128-token context (8), so rings are kept
    for sets, words in ((["serve.kv_blocks=4", "serve.prefill_tokens=64"],
                         "serve.kv_blocks = 4 KV blocks of serve.kv_block = 16 positions "
                         "cannot hold one context of model.seq_len = 128 tokens, which its full-attention blocks "
                         "read whole (its blocks with the 16-token sliding window keep their own rings): at least "
                         "8 are needed"),
                        (["serve.kv_block=0"], "serve.kv_block")):
        proc = subprocess.run(command(1, "hpcpipe.generate", ["--weights", str(directory), "--prompt", "abc",
                                                              *[a for s in sets for a in ("--set", s)]]),
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpipe: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and words in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_sequence_starting_in_a_slot_zeroes_its_rings(models):
    from hpcpipe.config import from_dict
    from hpcpipe.nn.core.decode import DecodeStage
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights

    source = resolve_weights(models["qwen2-layer-types"][0]).forward_only("float32")
    model = model_def(from_dict({"model": source.model, "parallel": {"pp": 1}}))
    stage = DecodeStage(model, range(model.n_layers), source.read(list(range(model.n_layers))), np, "float32", 3,
                        compiled=False, kv_block=PAGE, kv_blocks=3 * CONTEXT // PAGE, kv_ring=RING)
    rings = stage._ring_cache
    rings[...] = np.nan                       # what a failed sequence may leave (masked reads would give NaN)
    stage.set_pages(1, 0, [0, 1])
    assert not rings[:, :, :, RING:2 * RING].any() and np.isnan(rings[:, :, :, :RING]).all()
    assert np.isnan(rings[:, :, :, 2 * RING:]).all()
    stage.set_pages(1, 2, [2])                # a sequence growing keeps its rings
    assert not rings[:, :, :, RING:2 * RING].any()
    stage.clear_slot(2)
    assert not rings[:, :, :, 2 * RING:].any()
