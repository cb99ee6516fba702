"""Serving GPT models: token sampling, the no-cache reference, the pipelined engine and its HTTP front end."""
