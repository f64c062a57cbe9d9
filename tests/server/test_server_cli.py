"""`spirit serve`: registered, and user errors end in one line, not a traceback."""

from __future__ import annotations

import pytest

from spirit.cli import build_parser, main


def test_serve_is_registered():
    args = build_parser().parse_args(["serve", "--model", "m", "--port", "9000"])
    assert args.host == "127.0.0.1" and args.port == 9000 and args.max_queue == 16
    assert args.max_body_bytes == 1 << 20 and args.allow_methods is None


@pytest.mark.parametrize("argv", [
    ["serve", "--method", "warp"],
    ["serve", "--method", "vanilla", "--port", "70000"],
    ["serve", "--method", "vanilla", "--max-queue", "-1"],
    ["serve", "--method", "static"],
    ["serve", "--method", "vanilla", "--allow-methods", "vanilla,warp"],
    ["serve", "--method", "spirit", "--allow-methods", "vanilla"],
    ["serve", "--method", "vanilla", "--allow-methods", "vanilla,static"],
    ["serve", "--method", "vanilla", "--max-body-bytes", "0"],
    ["serve", "--method", "vanilla", "--skip", "attn:x"],
])
def test_user_errors(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("spirit: error:") and "Traceback" not in err
