"""Hypothesis settings for a property checked against live servers (router and worker processes).

No deadline: an example's time is the servers', not the test's. Derandomized, no example
database: every run (and CI) draws the same examples, so a failure reproduces. The stack is a
fixture shared by every example, and drawing a request body is not the slow part; hypothesis's
health checks for those two do not apply.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def live_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
