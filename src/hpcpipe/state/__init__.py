"""State in HDF5: the weights file format, the checkpoint directory protocol and manifest, reading by global layer
index from any layout (``sources``), and the collective save and load (``collective``)."""
