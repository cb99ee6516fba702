"""Training: ``python -m hpcpipe.train`` (``command``), the loop, the trainer that wires a rank, the engine that
runs its lowered program, the data feed and the start-up checks. Importing this package loads nothing."""
