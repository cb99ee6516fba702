"""Serving GPT models: an OpenAI-compatible HTTP front end (one background thread of world rank 0) and the
pipelined KV-cached decoding engine (MPI, main thread), joined only by the thread-safe :class:`broker.Broker`."""
