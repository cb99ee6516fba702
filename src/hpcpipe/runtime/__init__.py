"""What a rank runs on: MPI (``comm``, the only module that imports mpi4py), the (dp, pp) topology, the array
backend, run guards (stop signals, watchdog, step decision) and the test hooks (``faults``)."""
