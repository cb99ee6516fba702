"""Paged KV cache, automatic prefix caching and prompt-lookup speculation through the real server.

`mpiexec ... python -m hpcpipe.serve` with small KV blocks: requests that share a prefix (a system prompt, the
next turn of a chat) reuse its cached KV blocks and still give the reference's text, the same as a server
without prefix caching; /metrics counts the hits, the cached tokens and the blocks several running sequences
share; a pool too small for the traffic evicts cached blocks and loses no request; n-gram speculation gives the
reference's greedy and seeded text at pp = 1, pp = 2 and tp = 2 and counts its acceptance.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from support.launch import one_error
from support.serve import CHARS, Server, encode, generate, make_weights

from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SEQ_LEN = 160
BLOCK = 8
SYSTEM = "you are a careful assistant. answer briefly, cite nothing, and never repeat the question back. "


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix") / "prefix.h5"
    return path, make_weights(path, seq_len=SEQ_LEN)


def text_of(tokens):
    return "".join(CHARS[t] for t in tokens)


def metrics(url):
    """Every sample of /metrics by name."""
    out = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def ask(server, prompt, max_tokens, **kw):
    done = server.client(timeout=120).completions.create(model="prefix.h5", prompt=prompt, max_tokens=max_tokens,
                                                         temperature=kw.pop("temperature", 0), **kw)
    return done.choices[0].text


def reference(gpt, prompt, max_tokens, params=GREEDY):
    return text_of(reference_generate(gpt, encode(prompt), max_tokens, params))


@pytest.mark.parametrize("n,pp,tp,cache", [(2, 2, 1, True), (2, 2, 1, False), (2, 1, 2, True)])
def test_a_shared_prefix_is_reused_and_gives_the_same_text(model, n, pp, tp, cache):
    path, gpt = model
    turns = [SYSTEM + "what is a cat?", SYSTEM + "what is a dog?"]
    with Server(n, path, "--set", f"parallel.pp={pp}", "--set", f"parallel.tp={tp}", "--set", "serve.prefill_tokens=16",
                "--set", f"serve.kv_block={BLOCK}", "--set", f"serve.prefix_cache={str(cache).lower()}") as s:
        answers = [ask(s, prompt, 6) for prompt in turns]
        follow = turns[0] + answers[0] + " and a bird?"        # the chat's next turn: its whole history again
        answers.append(ask(s, follow, 6))
        for prompt, text in zip(turns + [follow], answers, strict=True):
            assert text == reference(gpt, prompt, 6), prompt
        m = metrics(s.url)
        assert m["hpcpipe_kv_blocks"] == 32 * -(-SEQ_LEN // BLOCK)     # serve.max_sequences (32) whole contexts
        assert m["hpcpipe_prefix_cache_queries_total"] == 3
        assert m["hpcpipe_prefix_cache_queried_tokens_total"] == sum(len(p) for p in turns + [follow])
        # the second turn finds the full blocks of what it shares with the first (the system prompt and more),
        # the follow-up those of the first turn and its answer but the last token (never fed to the model)
        shared = len(SYSTEM + "what is a ")
        want = (shared // BLOCK + (len(turns[0]) + 5) // BLOCK) * BLOCK if cache else 0
        assert m["hpcpipe_prefix_cache_cached_tokens_total"] == want, (m, s.output())
        assert m["hpcpipe_prefix_cache_hits_total"] == (2 if cache else 0)
        queried = m["hpcpipe_prefix_cache_queried_tokens_total"]
        assert m["hpcpipe_prefix_cache_hit_rate"] == pytest.approx(want / queried)
        assert m["hpcpipe_kv_blocks_cached"] > 0 if cache else m["hpcpipe_kv_blocks_cached"] == 0
        s.signal()
        assert s.stopped_cleanly(), s.output()


def test_clients_sharing_a_system_prompt_share_its_blocks(model):
    path, gpt = model
    prompts = [SYSTEM + f"question {a}{b}?" for a in "abcd" for b in "efghijkl"]          # 32 clients
    answers, errors, shared = {}, [], []
    with Server(1, path, "--set", f"serve.kv_block={BLOCK}", "--set", "serve.max_sequences=32",
                env={"HPCPIPE_STEP_SLEEP": "0.02"}) as s:
        assert ask(s, SYSTEM + "hello", 2) == reference(gpt, SYSTEM + "hello", 2)      # computes the system prompt

        def one(i):
            try:
                answers[i] = ask(s, prompts[i], 12)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((i, repr(exc)))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            shared.append(metrics(s.url)["hpcpipe_kv_blocks_shared"])
            time.sleep(0.05)
        for t in threads:
            t.join(120)
        assert not errors, (errors, s.output())
        for i, text in answers.items():
            assert text == reference(gpt, prompts[i], 12), i
        m = metrics(s.url)
        # every one of the 32 found the system prompt's full blocks; while they ran, those blocks were held by
        # several sequences at once (one copy in memory, not 32)
        # (at least the system prompt's; a request admitted after another's prompt ran finds " question" too)
        least, most = len(SYSTEM) // BLOCK * BLOCK, len(SYSTEM + "question ") // BLOCK * BLOCK
        assert 32 * least <= m["hpcpipe_prefix_cache_cached_tokens_total"] <= 32 * most, m
        assert least // BLOCK <= max(shared) <= most // BLOCK, shared
        assert m["hpcpipe_kv_blocks_shared"] == 0 and m["hpcpipe_kv_blocks_in_use"] == 0
        s.signal()
        assert s.stopped_cleanly(), s.output()


def test_a_pool_too_small_for_the_traffic_evicts_and_loses_no_request(model):
    # 22 blocks of 8: one context of 160 and a little more; 12 requests with 4 different prefixes
    path, gpt = model
    prompts = [f"{c * 3} " * 20 + SYSTEM[:30 + 3 * i] for i, c in enumerate("abcd" * 3)]
    answers, errors = {}, []
    with Server(2, path, "--set", "parallel.pp=2", "--set", f"serve.kv_block={BLOCK}", "--set", "serve.kv_blocks=22",
                "--set", "serve.max_sequences=4") as s:
        def one(i):
            try:
                answers[i] = ask(s, prompts[i], 8)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((i, repr(exc)))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and len(answers) == len(prompts), (errors, s.output())
        for i, text in answers.items():
            assert text == reference(gpt, prompts[i], 8), i
        m = metrics(s.url)
        assert m["hpcpipe_kv_evictions_total"] > 0 and m["hpcpipe_kv_blocks_in_use"] == 0, m
        s.signal()
        assert s.stopped_cleanly(), s.output()


@pytest.mark.parametrize("n,pp,tp", [(1, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_prompt_lookup_speculation_gives_the_plain_text(model, n, pp, tp):
    path, gpt = model
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the", "abab abab abab abab abab ab"]
    with Server(n, path, "--set", f"parallel.pp={pp}", "--set", f"parallel.tp={tp}", "--set", "serve.speculate=ngram",
                "--set", "serve.speculate_tokens=4", "--set", f"serve.kv_block={BLOCK}") as s:
        for prompt in prompts:
            assert ask(s, prompt, 30) == reference(gpt, prompt, 30), prompt
        seeded = SamplingParams(temperature=0.8, seed=7)
        assert ask(s, prompts[0], 30, temperature=0.8, seed=7) == reference(gpt, prompts[0], 30, seeded)
        m = metrics(s.url)
        assert m["hpcpipe_spec_steps_total"] > 0 and m["hpcpipe_spec_accepted_tokens_total"] > 0, m
        assert m["hpcpipe_spec_accepted_tokens_total"] <= m["hpcpipe_spec_proposed_tokens_total"]
        assert m["hpcpipe_spec_acceptance_rate"] == pytest.approx(
            m["hpcpipe_spec_accepted_tokens_total"] / m["hpcpipe_spec_proposed_tokens_total"])
        assert m["hpcpipe_generated_tokens_total"] == 90
        s.signal()
        assert s.stopped_cleanly(), s.output()


def test_a_draft_model_proposes_and_the_text_stays_the_reference(model, tmp_path):
    # the model as its own draft: every proposal is the model's own greedy choice, so nearly all are accepted
    # (only the draft's cache bookkeeping could make them differ); a smaller draft: the text is still the model's
    path, gpt = model
    small = tmp_path / "small.h5"
    make_weights(small, seq_len=SEQ_LEN, d_model=8, n_blocks=1, seed=5)
    prompt = SYSTEM + "what is a cat?"
    for draft in (path, small):
        with Server(2, path, "--set", "parallel.pp=2", "--set", "serve.speculate=draft",
                    "--set", f"serve.draft={draft}", "--set", "serve.speculate_tokens=3",
                    "--set", f"serve.kv_block={BLOCK}") as s:
            assert ask(s, prompt, 24) == reference(gpt, prompt, 24)
            assert ask(s, SYSTEM + "what is a dog?", 12) == reference(gpt, SYSTEM + "what is a dog?", 12)  # a hit
            m = metrics(s.url)
            proposed, accepted = m["hpcpipe_spec_proposed_tokens_total"], m["hpcpipe_spec_accepted_tokens_total"]
            assert proposed > 0 and (accepted == proposed if draft == path else accepted <= proposed), m
            s.signal()
            assert s.stopped_cleanly(), s.output()


def test_a_draft_model_with_another_tokenizer_is_one_line_and_exit_2(model, tmp_path):
    path, _ = model
    other = tmp_path / "bytes.h5"
    make_weights(other, seq_len=SEQ_LEN, tokenizer={"kind": "bytes"})
    proc, _ = generate(tmp_path, 1, path, "abc", "--max-new-tokens", "2", "--set", "serve.speculate=draft",
                       "--set", f"serve.draft={other}")
    one_error(proc, "serve.draft", "another tokenizer")


def test_a_pool_smaller_than_one_context_is_one_line_and_exit_2(model, tmp_path):
    path, _ = model
    proc, _ = generate(tmp_path, 1, path, "abc", "--max-new-tokens", "2", "--set", "serve.kv_blocks=9")
    one_error(proc, "serve.kv_blocks = 9", "at least 10")
