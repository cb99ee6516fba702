"""The ``served`` fixture of the test_serve_http_* files: make running servers, close them after the test."""

import pytest


@pytest.fixture
def served():
    """Return a maker of running servers (keywords as http_harness.Served takes); close each after the test."""
    # imported here, so the other serve tests do not load the HTTP stack for nothing
    from http_harness import Served

    made = []

    def make(**kw):
        s = Served(**kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()
