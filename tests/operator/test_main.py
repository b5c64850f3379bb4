"""`pdserve operator` command line and configuration errors (no cluster needed: they are
reported before the operator connects)."""

from __future__ import annotations

import pytest

from pdserve.operator.config import OperatorConfig
from pdserve.cli.main import main


def test_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["operator", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--namespace" in out and "--all-namespaces" in out


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (
            ["--namespace", "a", "--all-namespaces"],
            {},
            "argument --all-namespaces/-A: not allowed with argument --namespace/-n",
        ),
        (["--resync-seconds", "0"], {}, "resync interval must be > 0 seconds"),
        (["--resync-seconds", "soon"], {}, "argument --resync-seconds: invalid float value: 'soon'"),
        ([], {"PDSERVE_OPERATOR_RESYNC_SECONDS": "fast"}, "PDSERVE_OPERATOR_RESYNC_SECONDS must be a number"),
    ],
)
def test_bad_configuration_is_a_clear_error(argv, env, message, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        code = main(["operator", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_config_from_env_and_overrides():
    c = OperatorConfig.from_env({"PDSERVE_OPERATOR_RESYNC_SECONDS": "5"}, namespaces=("a", "b"), all_namespaces=None)
    assert (c.resync_interval_s, c.namespaces, c.all_namespaces) == (5.0, ("a", "b"), False)
    with pytest.raises(ValueError, match="mutually exclusive"):
        OperatorConfig(namespaces=("a",), all_namespaces=True)
