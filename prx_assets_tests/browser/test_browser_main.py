"""``python -m prx_assets.browser`` refuses what it cannot do in one line, not a traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from prx_assets.browser.__main__ import main
from prx_assets.core.lab import Lab
from prx_assets.core.tables import IMAGES


def test_a_port_outside_the_range_is_a_usage_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--data-root", str(tmp_path), "--port", "99999"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "port 99999 is outside 0-65535" in err and "Traceback" not in err


def test_a_port_in_use_is_an_error_that_says_so(tmp_path: Path, capsys) -> None:
    Lab(tmp_path / "lab").ensure(IMAGES)  # a lab, so the browser gets as far as listening
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--data-root", str(tmp_path), "--port", str(port), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
