"""Hooks for every test of a run, tests/ and e2e/ alike.

A conftest's own item hooks reach only the tests below its directory; these are registered as a
plugin (`register`, from tests/conftest.py and e2e/conftest.py) so that they see all of them:

- The control plane stops once this process's k8s modules are through (tests/conftest.py orders
  them together and stashes their set under K8S_UNIT), not at the session's end: idle, etcd,
  the apiserver and the controllers still take a fifth of a core or more, which the rest of the
  run on CI's 2 cores needs. The last of those modules may be an e2e one.
- CPU seconds per test module, the measure of CI's cost on a 2-core machine. A test's wall time
  says little there: two xdist workers and every server they start share the cores, so a test
  waits on its neighbours' work as much as on its own. What a module costs is the CPU its process
  and the processes it started and reaped used (a module-scoped server's is counted at the
  module's last test, when its fixture stops it). Each test records its seconds as the junit
  property `cpu_s` (and pytest's own part, the tests run in this process, as `cpu_in_process_s`);
  the terminal summary sums them per module, largest first.
- The project's byte code is compiled once before any test starts a process (`compile_project`).
"""

from __future__ import annotations

import collections
import compileall
import resource
import sys
import tomllib
from pathlib import Path

import pytest

from tests.k8s_cluster import stop_cluster
from tests.xdist_scopes import module_of

K8S_UNIT = pytest.StashKey[set]()
_START = pytest.StashKey[tuple[float, float]]()
TOP = 25
ROOT = Path(__file__).resolve().parents[2]
# The folders of the installed packages (pdserve.worker -> worker/, ...), as pyproject.toml maps them.
PACKAGES = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())


def register(config: pytest.Config) -> None:
    plugin = sys.modules[__name__]
    if config.pluginmanager.is_registered(plugin):
        return
    config.pluginmanager.register(plugin, "pdserve-run-hooks")
    if not hasattr(config, "workerinput"):  # the run's first process: xdist's controller, or the only one
        compile_project()


def compile_project() -> None:
    """Where the environment sets PYTHONDONTWRITEBYTECODE (CI's machine does), no process caches
    the byte code it compiles, so each of the run's several hundred worker, router and CLI
    processes compiled the ~140 project modules it imports again: about 0.3 CPU-s a start on
    CI's 2 cores. Compiled here once (a few CPU-s), they are read instead; a source newer than
    its cached code is compiled again as usual. Without the setting, processes cache it themselves."""
    if sys.dont_write_bytecode:
        for package in PACKAGES:
            compileall.compile_dir(ROOT / package, quiet=1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        unit = item.config.stash.get(K8S_UNIT, set())
        if module_of(item.nodeid) in unit and (nextitem is None or module_of(nextitem.nodeid) not in unit):
            stop_cluster(item.config)


def cpu_seconds() -> tuple[float, float]:
    """(this process and its reaped children, this process alone)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    alone = own.ru_utime + own.ru_stime
    return alone + children.ru_utime + children.ru_stime, alone


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_START] = cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # The teardown's report is made once it is done (module fixtures stopped with the module's
    # last test) and carries the item's properties: to the junit file, and under xdist to the
    # controller, whose summary below reads them.
    if call.when == "teardown" and _START in item.stash:
        (total, alone), (total0, alone0) = cpu_seconds(), item.stash[_START]
        item.user_properties += [("cpu_s", round(total - total0, 2)), ("cpu_in_process_s", round(alone - alone0, 2))]
    return (yield)


def pytest_terminal_summary(terminalreporter):
    per_module: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) != "teardown":
                continue
            props = dict(getattr(r, "user_properties", ()))
            if "cpu_s" in props:
                row = per_module[module_of(r.nodeid)]
                row[0] += 1
                row[1] += props["cpu_s"]
                row[2] += props.get("cpu_in_process_s", 0.0)
    if not per_module:
        return
    total, alone = (sum(v[i] for v in per_module.values()) for i in (1, 2))
    terminalreporter.write_sep("=", f"CPU seconds per module: {total:.0f} with the processes the tests started, "
                                    f"{alone:.0f} in pytest's own")
    terminalreporter.write_line(f"{'all':>8}  {'own':>6}  tests  module")
    for module, (n, cpu, own) in sorted(per_module.items(), key=lambda kv: -kv[1][1])[:TOP]:
        terminalreporter.write_line(f"{cpu:8.1f}  {own:6.1f}  {n:5d}  {module}")
