"""Every Python example in the README runs as written and ends by itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("code", BLOCKS, ids=[f"example{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=README.parent)
    assert done.returncode == 0, done.stderr
    if "serve_tcp, echo" in code:
        assert "b'hello'\nb''\n" in done.stdout
        assert "<Reason.IDLE: 'idle'>: 1" in done.stdout
    if "slowloris" in code:
        assert "ERR request head too slow" in done.stdout
    if "on_presence" in code:
        assert "sensor-17 online None" in done.stdout
        assert "sensor-17 offline keepalive-timeout silent for 1.5s" in done.stdout
    if "pump-7" in code:
        assert "session present: 0\nsession present: 1\nwaiting for it: b'open valve'" in done.stdout
    if "serve_http" in code:
        assert "b'hello, trio\\n'" in done.stdout
        assert "b'HTTP/1.1 408 Request Timeout'" in done.stdout
    if "serve_asgi" in code and "dead_phone" not in code:
        assert "b'hello, trio from ASGI\\n'" in done.stdout
    if "hello over TLS" in code:
        assert "b'hello over TLS\\n'\nb''\n1 " in done.stdout
        assert "<HandshakeFailure.TIMEOUT: 'timeout'>: 1" in done.stdout
    if "KeeperCollector" in code:
        assert 'idlekeeper_expired_total{reason="idle",worker="0"} 1.0' in done.stdout
    if "gone_events" in code:
        assert "idle after 0.2s\nidle after 0.4s\n" in done.stdout
    if "last_words" in code:
        assert done.stdout == "b'bye: idle\\n'\nb''\n"
    if "dead_phone" in code:
        assert "echo: hello\n" in done.stdout
        assert "dead phone closed: 1011 keepalive ping timeout\n" in done.stdout
        assert "app heard the client go: 1011 keepalive ping timeout\n" in done.stdout
    if "ws-lamp" in code:
        assert "presence: ws-lamp offline keepalive-timeout\n" in done.stdout
        assert "$SYS/presence/ws-lamp online\n$SYS/presence/ws-lamp offline\n" in done.stdout
    if "call_every" in code:
        assert done.stdout.count("every 100 ms") == 3
        assert done.stdout.count("once") == 1
