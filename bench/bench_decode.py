"""One decode step of many sequences through hpcpipe.nn.core.decode.DecodeStage: KV cache against full recompute.

    python bench/bench_decode.py                     # d_model 256, 8 blocks, seq_len 128, 32 sequences, float32
    python bench/bench_decode.py --dtype float64 --sequences 8 --repeats 20

One process, one BLAS thread. The sequences (slots 0..n-1) hold about
``--cached`` tokens each (lengths spread +-8). Timed, interleaved and repeated:

* cache: one forward of the n new tokens (n decode segments of length 1);
* recompute: the same step without a cache, as the engine's no-cache baseline
  sends it (each whole sequence as one segment with start 0);
* model.forward: the training forward of the (n, longest) batch, the
  sequential reference's cost (padding every sequence to the longest).

Prints best and median milliseconds per step and the speed-ups (best against best).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                     "BLIS_NUM_THREADS", "HPCPIPE_THREADS")})

import numpy as np  # noqa: E402  (after the thread caps)

from hpcpipe.nn.core.decode import DecodeStage, Segment  # noqa: E402
from hpcpipe.nn.core.decoder_model import Decoder  # noqa: E402
from hpcpipe.nn.gpt.model import GPTModel  # noqa: E402
from hpcpipe.nn.gpt.shape import GPTShape  # noqa: E402


def main() -> None:
    """Time the three ways of one step and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--cached", type=int, default=64, help="tokens already cached per sequence (about)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    shape = GPTShape(vocab=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads,
                     n_blocks=args.blocks)
    model = Decoder(GPTModel(shape), dtype=args.dtype, seed=0)
    arrays = {i: {name: np.array(v) for name, v in group.items()} for i, group in enumerate(model.params)}
    stage = DecodeStage(GPTModel(shape), range(shape.n_groups), arrays, np, args.dtype, slots=args.sequences)
    rng = np.random.default_rng(0)
    cached = np.clip(rng.integers(args.cached - 8, args.cached + 9, args.sequences), 1, args.seq_len - 1)
    seqs = [rng.integers(0, args.vocab, n + 1) for n in cached]
    for slot, seq in enumerate(seqs):
        stage.forward(seq[:-1], [Segment(slot, 0, len(seq) - 1)])
    step = ([Segment(slot, int(n), 1) for slot, n in enumerate(cached)], np.array([s[-1] for s in seqs]))
    whole = ([Segment(slot, 0, len(s)) for slot, s in enumerate(seqs)], np.concatenate(seqs))
    longest = int(cached.max()) + 1
    batch = np.stack([np.resize(s, longest) for s in seqs])
    runs = {"cache": lambda: stage.forward(step[1], step[0]),
            "recompute": lambda: stage.forward(whole[1], whole[0]),
            "model.forward": lambda: model.forward(batch)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in times.items()}
    print(f"d_model {args.d_model}, {args.blocks} blocks, {args.heads} heads, seq_len {args.seq_len}, "
          f"{args.sequences} sequences at {int(cached.min())}..{int(cached.max())} cached tokens, {args.dtype}, "
          f"{args.repeats} repeats, load average {os.getloadavg()[0]:.2f}")
    print("| step | best ms | median ms | tokens/s (best) | vs cache |")
    print("|---|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {best[name] * 1e3:.2f} | {statistics.median(t) * 1e3:.2f} | "
              f"{args.sequences / best[name]:.0f} | {best[name] / best['cache']:.1f}x |")


if __name__ == "__main__":
    main()
