"""One tensor-parallel activation-exchange job (run under mpiexec -n 2*tp by bench_tp.py): prints one JSON line.

    mpiexec -n 4 python bench/tp_exchange_worker.py --mode share --rows 8192 --width 768 --repeats 50

Stage 0's tp ranks all hold the same (rows, width) float32 activation and hand it to stage 1's tp ranks,
which all need the whole of it, as a pipeline boundary does under tensor parallelism. Two ways:

* ``share`` (hpcpipe's): each tp rank sends 1/tp of the elements to its peer in the next stage (PipeComm's
  isend/recv with share=True), then the next stage's ranks allgather the shares;
* ``root``: tp rank 0 sends all of it to tp rank 0 of the next stage, which broadcasts it to its tp peers.

Reported: the median and best seconds of one exchange (from the first send to the last receiver's
completion, measured on stage 1's tp rank 0 after a barrier), over --repeats exchanges.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    """Time --repeats exchanges in the chosen mode and print the JSON line on world rank 0."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["share", "root"], default="share")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()

    from mpi4py import MPI

    from hpcpipe.runtime.backend import select_backend
    from hpcpipe.runtime.comm import PipeComm, Poller
    from hpcpipe.runtime.topology import make_topology

    world = MPI.COMM_WORLD
    tp = world.Get_size() // 2
    topo = make_topology(world, 1, 2, tp)
    poller = Poller()
    comm = PipeComm(topo.pp_comm, topo.dp_comm, world, select_backend("numpy"), poller, tp_comm=topo.tp_comm)
    shape = (args.rows, args.width)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    times = []
    for i in range(args.repeats + 2):
        world.Barrier()
        start = time.perf_counter()
        if topo.pp_rank == 0:
            if args.mode == "share":
                comm.isend(x, dest=1, tag=i, share=True)
            elif topo.tp_rank == 0:
                comm.isend(x, dest=1, tag=i)
            comm.wait_sends()
        else:
            if args.mode == "share":
                got = comm.recv(shape, np.float32, source=0, tag=i, share=True)
            else:
                got = np.empty(shape, dtype=np.float32)
                if topo.tp_rank == 0:
                    poller.wait([topo.pp_comm.Irecv(got, source=0, tag=i)])
                poller.wait([topo.tp_comm.Ibcast(got, root=0)])
            if i == 0 and not np.array_equal(got, x):
                raise SystemExit(f"{args.mode}: the received activation differs from the sent one")
        # the exchange ends when the slowest receiver has the whole activation
        seconds = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= 2:
            times.append(seconds)
    if world.Get_rank() == 0:
        print(json.dumps({"mode": args.mode, "tp": tp, "rows": args.rows, "width": args.width,
                          "bytes": int(x.nbytes), "median_s": statistics.median(times), "min_s": min(times)}))
    topo.free()


if __name__ == "__main__":
    main()
