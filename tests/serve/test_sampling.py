"""Token sampling (hpcpipe.serve.sampling): greedy, temperature, top-k, top-p, one draw per token, reproducibility
whatever the batch, the empirical distribution against softmax(logits / temperature), parameter checks."""

import numpy as np
import pytest

from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.serve.sampling import Sampler, SamplingParams


def _softmax(z):
    p = np.exp(z - z.max())
    return p / p.sum()


def _counts(params, logits, n):
    sampler = Sampler(params)
    return np.bincount([sampler.next_token(logits) for _ in range(n)], minlength=logits.size)


def _chi_square(counts, probs):
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), int(keep.sum()) - 1


def test_greedy_is_argmax_first_on_ties_and_draws_nothing():
    sampler = Sampler(SamplingParams(temperature=0, seed=3))
    assert sampler.next_token(np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)) == 1
    assert sampler.next_token(np.array([-3.0, -2.0, -2.5])) == 1
    assert sampler.rng.random() == np.random.Generator(np.random.PCG64(3)).random()


def test_one_uniform_draw_per_sampled_token():
    logits = np.random.default_rng(0).standard_normal(50)
    for params in (SamplingParams(seed=5), SamplingParams(temperature=0.5, top_k=7, top_p=0.8, seed=5)):
        sampler = Sampler(params)
        for _ in range(9):
            sampler.next_token(logits)
        fresh = np.random.Generator(np.random.PCG64(5))
        fresh.random(9)
        assert sampler.rng.random() == fresh.random()


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed():
    rng = np.random.default_rng(1)
    steps = [rng.standard_normal(40) for _ in range(30)]
    params = SamplingParams(temperature=1.3, top_p=0.95, seed=11)
    first, second = Sampler(params), Sampler(params)
    runs = [[first.next_token(z) for z in steps], [second.next_token(z) for z in steps]]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 5
    one, other = Sampler(params), Sampler(SamplingParams(temperature=1.3, top_p=0.95, seed=12))
    assert [one.next_token(z) for z in steps] != [other.next_token(z) for z in steps]


def test_the_same_seed_gives_the_same_tokens_in_a_batch_and_alone():
    """Logits computed beside other sequences in one DecodeStage call give the same tokens as computed alone."""
    shape = GPTShape(vocab=31, seq_len=20, d_model=16, n_heads=2, n_blocks=2)
    model = Decoder(GPTModel(shape), dtype="float32", seed=4)
    arrays = {i: {n: np.array(v) * 8 for n, v in g.items()} for i, g in enumerate(model.params)}
    alone = DecodeStage(GPTModel(shape), range(shape.n_groups), arrays, np, "float32", slots=1)
    batch = DecodeStage(GPTModel(shape), range(shape.n_groups), arrays, np, "float32", slots=4)
    params = SamplingParams(temperature=0.9, top_k=10, seed=21)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2]]
    samplers = [Sampler(params) for _ in prompts]
    segments = [Segment(i, 0, len(p)) for i, p in enumerate(prompts)]
    x = np.array(sum(prompts, []))
    batched = [[] for _ in prompts]
    for _ in range(10):
        logits = batch.forward(x, segments)
        for i, row in enumerate(logits):
            batched[i].append(samplers[i].next_token(row))
        segments = [Segment(s.slot, s.start + s.length, 1) for s in segments]
        x = np.array([b[-1] for b in batched])
    sampler, tokens = Sampler(params), []
    logits = alone.forward(np.array(prompts[2]), [Segment(0, 0, len(prompts[2]))])
    for t in range(10):
        tokens.append(sampler.next_token(logits[0]))
        logits = alone.forward(np.array(tokens[-1:]), [Segment(0, len(prompts[2]) + t, 1)])
    assert tokens == batched[2]
    assert len(set(tokens)) > 1       # really sampled


def test_top_k_1_and_tiny_top_p_equal_greedy():
    rng = np.random.default_rng(2)
    for seed in range(20):
        z = rng.standard_normal(64) * 3
        z[rng.integers(64)] = z.max()               # a tie for the maximum: the lower index wins
        greedy = Sampler(SamplingParams(temperature=0)).next_token(z)
        assert Sampler(SamplingParams(temperature=2.0, top_k=1, seed=seed)).next_token(z) == greedy
        assert Sampler(SamplingParams(temperature=2.0, top_p=1e-9, seed=seed)).next_token(z) == greedy


def test_draws_follow_softmax_over_temperature():
    z = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -2.0, 1.5, 0.7])
    n = 20000
    for temperature in (1.0, 0.6, 2.5):
        counts = _counts(SamplingParams(temperature=temperature, seed=17), z, n)
        stat, dof = _chi_square(counts, _softmax(z / temperature))
        assert stat < 26.0, f"chi-square {stat:.1f} with {dof} dof at temperature {temperature}"   # p < 0.001


def test_draws_follow_the_truncated_distributions():
    z = np.log(np.array([0.05, 0.3, 0.1, 0.5, 0.05]))
    n = 20000
    # top_k = 3 keeps 0.5, 0.3, 0.1 and renormalises
    counts = _counts(SamplingParams(top_k=3, seed=1), z, n)
    want = np.array([0, 0.3, 0.1, 0.5, 0]) / 0.9
    stat, dof = _chi_square(counts, want)
    assert stat < 14.0, f"top_k chi-square {stat:.1f} with {dof} dof"
    # top_p = 0.75: 0.5 alone does not reach it, 0.5 + 0.3 does
    counts = _counts(SamplingParams(top_p=0.75, seed=2), z, n)
    stat, dof = _chi_square(counts, np.array([0, 0.3, 0, 0.5, 0]) / 0.8)
    assert stat < 11.0, f"top_p chi-square {stat:.1f} with {dof} dof"
    # ties at the top_k boundary: the lower index stays
    counts = _counts(SamplingParams(top_k=2, seed=3), np.array([0.0, 1.0, 0.0, 1.0, 1.0]), 3000)
    assert counts[[0, 2, 4]].sum() == 0 and counts[1] > 0 and counts[3] > 0


def test_any_float_dtype_and_device_arrays():
    class Device:
        """A stand-in for a CuPy array: only .get() returns host data."""

        def __init__(self, a):
            self.a = a

        def get(self):
            return self.a

    z = np.array([0.1, 3.0, -1.0, 2.9])
    for dtype in (np.float16, np.float32, np.float64):
        assert Sampler(SamplingParams(temperature=0)).next_token(z.astype(dtype)) == 1
    params = SamplingParams(temperature=0.7, seed=9)
    assert Sampler(params).next_token(Device(z.astype(np.float32))) == Sampler(params).next_token(z.astype(np.float32))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -3}, "seed must be an integer >= 0"),
])
def test_nonsense_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_logits_are_refused():
    sampler = Sampler(SamplingParams())
    with pytest.raises(ValueError, match="1-D logits"):
        sampler.next_token(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="finite logits"):
        sampler.next_token(np.array([np.nan, 1.0]))
    with pytest.raises(ValueError, match="SamplingParams"):
        Sampler({"temperature": 0})
