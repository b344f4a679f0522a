"""The unit tier: in process, fast, no real parts. A unit test that starts a process or dials a socket fails at
once (the guard below), so the tier stays what `pytest -m unit` promises: a broken build fails in seconds."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def no_process_no_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a unit test starts no process and dials no socket: it belongs to tests/ (e2e)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refused)
    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(socket.socket, "connect", refused)
    yield
