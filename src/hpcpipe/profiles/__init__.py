"""Measured profiles, read: layer costs, the communication model, the cache files and the stage cut they give.

The planner (:mod:`hpcpipe.plan`) measures profiles and writes them here; training,
inference and serving only read them (``parallel.stage_layers = "profile"``).
Nothing in this package measures, launches a process or imports the planner.
"""
