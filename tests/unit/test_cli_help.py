"""`portico serve --help` as a user reads it: an option whose default comes from the configuration file says so,
rather than naming server/default.yaml's value (a user whose file sets `listen.port: 9000` was told 8080)."""

from __future__ import annotations

import pytest

from server.cli import main

SETTINGS = {"--host": "listen.host", "--port": "listen.port", "--admin-port": "envoy_admin_port",
            "--metrics-port": "metrics_port"}


def _serve_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    return text[text.index("options:"):]  # the options' descriptions, not the usage line


@pytest.mark.parametrize("option", sorted(SETTINGS))
def test_serve_options_name_the_setting_they_default_to(capsys, option):
    text = _serve_help(capsys)
    described = text[text.index(option + " "):]
    described = described[:described.index(" --", 1)]
    assert SETTINGS[option] in described, described


def test_admin_option_says_what_an_admin_key_may_do(capsys):
    """An admin key is not only for KeyService: the limit status, the catalog, the console, every key's usage."""
    with pytest.raises(SystemExit):
        main(["keys", "create", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    described = text[text.index("--admin "):]
    for what in ("limits", "catalog", "console", "usage"):
        assert what in described, described
