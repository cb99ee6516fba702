"""Unit tests of the serving text stream (partial UTF-8, stop strings) and the Prometheus metrics text."""

from __future__ import annotations

import numpy as np
import pytest
from support.prometheus_text import parse_prometheus

from hpcpipe.serve.metrics import LATENCY_BUCKETS, Metrics
from hpcpipe.serve.textstream import TextStream
from hpcpipe.state.tokenizer import Tokenizer, chars_tokenizer

BYTES = Tokenizer("bytes")


def feed_each(stream: TextStream, ids) -> list[str]:
    return [stream.feed([i]) for i in ids]


def test_partial_utf8_is_held_until_the_character_is_complete():
    s = TextStream(BYTES)
    out = feed_each(s, list("aé€😀".encode()))
    assert out == ["a", "", "é", "", "", "€", "", "", "", "😀"]
    assert s.finish() == "" and s.text == "aé€😀"


def test_an_incomplete_tail_at_the_end_becomes_one_replacement_character():
    s = TextStream(BYTES)
    assert feed_each(s, [104, 0xE2, 0x82]) == ["h", "", ""]
    assert s.finish() == "\ufffd"
    assert s.text == BYTES.decode([104, 0xE2, 0x82])


def test_random_bytes_in_random_chunks_decode_as_the_whole_sequence():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, 256, size=int(rng.integers(1, 40))).tolist()
        s = TextStream(BYTES)
        cuts = sorted(set(rng.integers(0, len(ids), size=4).tolist()) | {0, len(ids)})
        text = "".join(s.feed(ids[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)) + s.finish()
        assert text == BYTES.decode(ids)


def test_stop_string_across_token_boundaries_cuts_before_it():
    s = TextStream(BYTES, ["lo w"])
    out = feed_each(s, list(b"hello world"))
    assert "".join(out) == "hel" and s.stopped and s.text == "hel"
    assert out[:5] == ["h", "e", "", "l", ""]      # each "l" may start "lo w": held until the next byte
    assert s.feed([33]) == "" and s.finish() == ""


def test_held_prefix_is_released_when_it_does_not_become_a_stop_string():
    s = TextStream(BYTES, ["ab"])
    assert feed_each(s, list(b"aac")) == ["", "a", "ac"]
    assert not s.stopped
    s2 = TextStream(BYTES, ["xyz"])
    assert feed_each(s2, list(b"axy")) == ["a", "", ""]
    assert s2.finish() == "xy" and s2.text == "axy" and not s2.stopped


def test_the_earliest_of_several_stop_strings_wins_and_a_stop_may_be_multibyte():
    s = TextStream(BYTES, ["world", "o w"])
    assert s.feed(list(b"hello world")) == "hell" and s.stopped
    s = TextStream(BYTES, ["€"])
    assert "".join(feed_each(s, list("aé€b".encode()))) == "aé" and s.stopped


def test_stop_string_found_inside_one_token_batch_and_at_the_first_token():
    s = TextStream(BYTES, ["\n"])
    assert s.feed(list(b"\nabc")) == "" and s.stopped and s.text == ""


def test_chars_tokenizer_streams_whole_characters():
    tok = chars_tokenizer("abcé ")
    s = TextStream(tok, ["c é"])
    ids = tok.encode("ab c éa").tolist()
    assert "".join(feed_each(s, ids)) == "ab " and s.stopped
    s = TextStream(tok)
    assert feed_each(s, tok.encode("éa").tolist()) == ["é", "a"]


def test_byte_ids_outside_0_255_are_refused():
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        TextStream(BYTES).feed([300])


# ---- Prometheus text ------------------------------------------------------------------------------------


def test_metrics_text_parses_and_counts():
    m = Metrics()
    m.count_request(200)
    m.count_request(200)
    m.count_request(400)
    m.add_prompt_tokens(7)
    m.add_generated_tokens(5)
    m.set_gauges(queue_depth=3, running=2)
    m.observe_ttft(0.001)                          # exactly on a bound: counted in le="0.001"
    m.observe_ttft(40.0)                           # beyond the largest bound: only +Inf
    for gap in (0.0, 0.003, 0.02):
        m.observe_inter_token(gap)
    m.count_disconnect()
    s = parse_prometheus(m.render())
    assert s[("hpcpipe_requests_total", 'status="200"')] == 2
    assert s[("hpcpipe_requests_total", 'status="400"')] == 1
    assert s[("hpcpipe_prompt_tokens_total", "")] == 7
    assert s[("hpcpipe_generated_tokens_total", "")] == 5
    assert s[("hpcpipe_queue_depth", "")] == 3 and s[("hpcpipe_running_sequences", "")] == 2
    assert s[("hpcpipe_client_disconnects_total", "")] == 1
    t = "hpcpipe_time_to_first_token_seconds"
    assert s[(f"{t}_bucket", 'le="0.001"')] == 1 and s[(f"{t}_bucket", 'le="30.0"')] == 1
    assert s[(f"{t}_bucket", 'le="+Inf"')] == 2 and s[(f"{t}_sum", "")] == pytest.approx(40.001)
    i = "hpcpipe_inter_token_seconds"
    assert s[(f"{i}_bucket", 'le="0.001"')] == 1 and s[(f"{i}_bucket", 'le="0.005"')] == 2
    assert s[(f"{i}_count", "")] == 3
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] == 30.0


def test_the_parser_catches_a_broken_exposition():
    with pytest.raises(AssertionError):
        parse_prometheus("# TYPE x counter\nx{status=200} 1\n")
    with pytest.raises(AssertionError):
        parse_prometheus("y 1\n")
