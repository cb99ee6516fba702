"""The serving wire protocol (hpcpipe.serve.protocol): every message pickles to itself cheaply, tags never collide."""

from __future__ import annotations

import pickle
from dataclasses import fields

import numpy as np
import pytest

from hpcpipe.serve import protocol
from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.protocol import (
    MESSAGES,
    TAGS,
    Cancel,
    ClearSlot,
    Drain,
    Events,
    Forward,
    Idle,
    Probe,
    Result,
    StopPipeline,
    StopReplica,
    StopTP,
    Submit,
    Work,
)
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.scheduler import FAILED

PARAMS = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)
SAMPLES = [
    Submit(Request("cmpl-1-0", [3, 1, 4], 8, PARAMS, 12.5)),
    Cancel("cmpl-1-0"),
    StopReplica(),
    Events(1, [Event("cmpl-1-0", [7], None), Event("cmpl-2-0", [], "cancelled")], 3),
    Events(0, [], 0),
    Drain("SIGTERM"),
    Work(2, [(0, 0, 3), (1, 5, 1)], [(0, PARAMS)], [True, False], [4]),
    Idle(),
    StopPipeline(),
    Result(2, [17, -1, FAILED]),
    Probe(None),
    Probe("the model's forward is not finite: stage 1"),
    Forward([(3, 9, 1)]),
    ClearSlot(3),
    StopTP(),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_pickle_as_class_and_values(message):
    wire = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(wire)
    assert type(back) is type(message) and back == message
    # the cheap form: the class and the values, no field names (no instance dict, no slot state)
    assert not any(f.name.encode() in wire for f in fields(message) if len(f.name) > 3), wire
    for name in [f.name for f in fields(message)] + ["extra"]:
        # frozen and slotted: nothing changes or rides along unseen (Python 3.11 says TypeError for a new name)
        with pytest.raises((AttributeError, TypeError)):
            setattr(message, name, 1)


def test_every_message_class_has_a_sample_a_docstring_and_a_tag_of_one_communicator():
    assert {type(m) for m in SAMPLES} == set(MESSAGES)
    defined = {v for v in vars(protocol).values() if isinstance(v, type) and issubclass(v, protocol.Message)}
    assert defined - {protocol.Message} == set(MESSAGES)
    for cls in MESSAGES:
        assert cls.__doc__ and "->" in cls.__doc__.splitlines()[0], cls      # who sends it to whom
        assert sum(isinstance(cls.TAG, tags) for tags in TAGS) == 1, cls


def test_tags_are_distinct_and_leave_the_array_tag_free_on_every_communicator():
    every = []
    for tags in TAGS:
        used = [int(t) for t in tags]
        buffers = {cls.TAG + 1 for cls in MESSAGES if cls.BUFFER and isinstance(cls.TAG, tags)}
        assert len(set(used)) == len(used), tags
        assert not buffers & set(used), (tags, buffers)
        every += used + sorted(buffers)
    assert len(set(every)) == len(every), every      # apart across communicators too: no two tags share a value


def test_an_array_only_follows_a_message_that_carries_one():
    class Box:
        def __init__(self):
            self.sent = []

        def post(self, dest, tag, header, array=None):
            self.sent.append((dest, tag, header, array))

    box = Box()
    x = np.ones((2, 3))
    protocol.send(box, 1, Work(0, [(0, 0, 2)], [], [True], []), x)
    assert box.sent == [(1, 21, (Work(0, [(0, 0, 2)], [], [True], []),), x)]
    with pytest.raises(ValueError, match="Result carries no array"):
        protocol.send(box, 0, Result(0, [1]), x)
