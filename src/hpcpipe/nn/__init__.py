"""Models as layers with hand-written forward and backward (split into input and weight halves), losses, optimizers,
model kinds and their partition into stages. Written against ``xp`` (NumPy or CuPy); no MPI here."""
