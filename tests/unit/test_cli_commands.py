"""The ``sluice`` command: every sub-command listed and with an example in its --help, and a command
that runs imports only its own module (a service process does not pay for the others' imports)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.cli import COMMANDS, build_parser


def test_the_full_parser_lists_every_command_of_the_table() -> None:
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(choices) == list(COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("config", "keys", "topics", "pipeline")])
def test_each_command_alone_parses_its_help_with_an_example(command: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The parser built for one command (as ``main`` builds it) gives that command's whole --help."""
    with pytest.raises(SystemExit) as done:
        build_parser(command).parse_args([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out and f"sluice {command}" in out


def test_a_receiver_process_does_not_import_the_region_http_stack_nor_the_demo() -> None:
    """``sluice receiver`` builds its parser alone: fastapi (the region's and the admin page's), the demo
    and the other services are never imported; the full parser imports them all."""
    probe = ("import sys; from sluice.cli import build_parser; build_parser({arg}); "
             "print(sorted(m for m in ('fastapi', 'sluice.demo', 'sluice.admin.cli', 'sluice.region.http') "
             "if m in sys.modules))")
    alone = subprocess.run([sys.executable, "-c", probe.format(arg="'receiver'")], capture_output=True, text=True,
                           check=True)
    assert alone.stdout.strip() == "[]", alone.stdout
    every = subprocess.run([sys.executable, "-c", probe.format(arg="None")], capture_output=True, text=True,
                           check=True)
    assert "sluice.region.http" in every.stdout and "fastapi" in every.stdout
