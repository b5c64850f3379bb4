"""How pytest-xdist hands the suite to its workers (pyproject's addopts: `-n 2 --dist loadscope`).

The unit of work is a test module, so a module's fixtures (servers, checkpoints) are set up once,
on one worker, except that every module on the real control plane, and tests/image whose image
build they share, form one unit, "k8s": one worker runs them one after another on one cluster
(its session fixture) and builds the image once (two podman builds of one tag must not overlap).

Which module is a k8s one is known only after collection, in the workers (a test's `k8s` mark or
`k8s_cluster` fixture, possibly through a conftest's fixture); the scheduler runs in the
controller, which sees node ids only. xdist's own channel for this, the `xdist_group` mark under
`--dist loadgroup`, rewrites node ids, which pytest 9.2 no longer lets it do (pytest-xdist issue
1386: the groups are silently dropped). So the workers write the module-to-unit map to a file the
controller names in their `workerinput`, and the scheduler reads it once every worker has
collected. Units are handed out in collection order (tests/conftest.py sorts it: the k8s unit
first, then the modules with slow tests).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

K8S_UNIT = "k8s"
IMAGE_MODULES = ("tests/image/test_image.py",)
_INPUT_KEY = "pdserve_units_file"
_UNITS_FILE = pytest.StashKey[Path]()


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def record_units(config: pytest.Config, items: list[pytest.Item], k8s_modules: set[str]) -> None:
    """In a worker: write {module: unit} for the controller's scheduler (each worker writes the
    same map; the rename makes each write whole)."""
    path = getattr(config, "workerinput", {}).get(_INPUT_KEY)
    if path is None:
        return
    units = {module_of(i.nodeid): K8S_UNIT if module_of(i.nodeid) in k8s_modules else module_of(i.nodeid)
             for i in items}
    tmp = f"{path}.{config.workerinput['workerid']}"
    Path(tmp).write_text(json.dumps(units))
    os.replace(tmp, path)


class ModuleScheduling(LoadScopeScheduling):
    """xdist's loadscope with a module as the scope, and the k8s modules as one."""

    def __init__(self, config: pytest.Config, log=None, units_file: Path | None = None):
        super().__init__(config, log)
        self._units_file = units_file
        self._units: dict[str, str] | None = None

    def schedule(self) -> None:
        if self._units is None and self.collection_is_completed and self._units_file is not None:
            self._units = json.loads(self._units_file.read_text()) if self._units_file.exists() else {}
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return (self._units or {}).get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    config = node.config
    if _UNITS_FILE not in config.stash:
        tmp = Path(tempfile.mkdtemp(prefix="pdserve-xdist-"))
        config.add_cleanup(lambda: shutil.rmtree(tmp, ignore_errors=True))
        config.stash[_UNITS_FILE] = tmp / "units.json"
    node.workerinput[_INPUT_KEY] = str(config.stash[_UNITS_FILE])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    return ModuleScheduling(config, log, config.stash.get(_UNITS_FILE, None))
