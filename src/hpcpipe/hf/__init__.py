"""Hugging Face model directories in and out: config.json, safetensors weights (read per stage), tokenizer.json and
chat templates. Pure file I/O and text; no MPI, no training code."""
