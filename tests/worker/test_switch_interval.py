"""$PDSERVE_SWITCH_INTERVAL_MS: the worker process's GIL switch interval (KV stream threads take
the GIL back from a busy engine thread within it)."""

from __future__ import annotations

import sys

import pytest

from pdserve.worker.server.main import SWITCH_INTERVAL_ENV, set_switch_interval


@pytest.fixture(autouse=True)
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_unset_keeps_pythons_interval():
    before = sys.getswitchinterval()
    assert set_switch_interval({}) == before == sys.getswitchinterval()


def test_set_in_milliseconds():
    assert set_switch_interval({SWITCH_INTERVAL_ENV: "0.5"}) == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


@pytest.mark.parametrize("bad", ["fast", "0", "-1", "1000", "nan"])
def test_a_bad_value_names_the_variable(bad):
    before = sys.getswitchinterval()
    with pytest.raises(SystemExit, match=SWITCH_INTERVAL_ENV):
        set_switch_interval({SWITCH_INTERVAL_ENV: bad})
    assert sys.getswitchinterval() == before
