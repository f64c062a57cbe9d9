"""`spirit serve`: registered, and user errors end in one line, not a traceback."""

from __future__ import annotations

import pytest

from spirit.cli import build_parser, main


def test_serve_is_registered():
    args = build_parser().parse_args(["serve", "--model", "m", "--port", "9000"])
    assert args.host == "127.0.0.1" and args.port == 9000 and args.max_queue == 16


@pytest.mark.parametrize("argv", [
    ["serve", "--method", "warp"],
    ["serve", "--method", "vanilla", "--port", "70000"],
    ["serve", "--method", "vanilla", "--max-queue", "-1"],
    ["serve", "--method", "static"],
])
def test_user_errors(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("spirit: error:") and "Traceback" not in err
