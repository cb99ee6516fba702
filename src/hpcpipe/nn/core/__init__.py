"""The shared decoder core: layers, attention, norms, MLPs, RoPE, tensor-parallel cuts and KV-cached decoding."""
