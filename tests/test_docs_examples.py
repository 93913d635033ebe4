"""Every Python example in the README and the documentation runs as written and ends by itself.

Every ```python block of README.md and of each Markdown page under docs/ is run as a
script (cwd the repository root); so is every ``.. code-block:: python`` of an .rst
page. A block that is only a fragment is fenced ```python-fragment instead (shown as
Python, never run); keep those rare. Some examples' output is checked too, keyed by
their content.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]
RST_PAGES = sorted(p for p in DOCS.rglob("*.rst") if "_build" not in p.parts)


def _rst_blocks(text: str) -> list[str]:
    blocks = []
    for match in re.finditer(r"^( *)\.\. code-block:: python\n((?:\1 +:.*\n)*)\n((?:\1 +.*\n|\n)+)", text, flags=re.M):
        blocks.append(textwrap.dedent(match.group(3)))
    return blocks


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)):
            found.append((f"{page.relative_to(ROOT)}:{i}", code))
    for page in RST_PAGES:
        for i, code in enumerate(_rst_blocks(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}:{i}", code))
    return found


EXAMPLES = _examples()


def test_readme_and_docs_have_examples() -> None:
    pages = {name.rpartition(":")[0] for name, _ in EXAMPLES}
    assert "README.md" in pages
    assert len(EXAMPLES) >= 20
    assert len(pages) >= 8


def test_every_command_is_in_the_command_reference() -> None:
    from loadtest.__main__ import COMMANDS

    cli = (DOCS / "reference" / "cli.md").read_text()
    for command in COMMANDS:
        assert f"### `idlekeeper-loadtest {command}`" in cli, command
    for script in ("idlekeeper-heartbeat", "idlekeeper-passwd", "idlekeeper-http"):
        assert f"### `{script}`" in cli, script
    assert "### `python -m servers.echo`" in cli  # the demo's server, not installed as a script


def test_every_presence_field_is_in_the_schema() -> None:
    from servers.heartbeat.mqtt.endings import Offline
    from servers.heartbeat.presence.event import PresenceEvent

    full = PresenceEvent(
        status="online", client_id="x", peer="p", reason=Offline.DISCONNECT, silent_for=0.0, time=0.0,
        detail="d", epoch="e", node="n", keep_alive=1, claimed_client_id="c", username="u", protocol_level=5,
        reason_code=0x8D,
    )  # fmt: skip
    schema = (DOCS / "reference" / "presence-events.md").read_text()
    for key in full.to_dict():
        assert f"| `{key}` |" in schema, key


# What some examples must print, keyed by what their code holds: (markers all in the
# code, markers none of which is, lines that must all be in the output).
OUTPUTS: list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = [
    (("serve_tcp, echo",), (), ("b'hello'\nb''\n", "<Reason.IDLE: 'idle'>: 1")),
    (("slowloris",), (), ("ERR request head too slow",)),
    (
        ("on_presence",),
        ("MockClock",),
        ("sensor-17 online None", "sensor-17 offline keepalive-timeout silent for 1.5s"),
    ),
    (("pump-7",), (), ("session present: 0\nsession present: 1\nwaiting for it: b'open valve'",)),
    (("serve_http",), (), ("b'hello, trio\\n'", "b'HTTP/1.1 408 Request Timeout'")),
    (("serve_asgi",), ("dead_phone", "behind_proxy"), ("b'hello, trio from ASGI\\n'",)),
    (
        ("hello over TLS",),
        ("serve_protocol",),
        ("b'hello over TLS\\n'\nb''\n1 ", "<HandshakeFailure.TIMEOUT: 'timeout'>: 1"),
    ),
    (
        ("hello over TLS", "serve_protocol"),
        (),
        ("b'hello over TLS, None\\n'\nb''\n1 ", "<HandshakeFailure.TIMEOUT: 'timeout'>: 1"),
    ),
    (("KeeperCollector",), (), ('idlekeeper_expired_total{reason="idle",worker="0"} 1.0',)),
    (("gone_events",), (), ("idle after 0.2s\nidle after 0.4s\n",)),
    (
        ("dead_phone",),
        (),
        (
            "echo: hello\n",
            "dead phone closed: 1011 keepalive ping timeout\n",
            "app heard the client go: 1011 keepalive ping timeout\n",
        ),
    ),
    (
        ("ws-lamp",),
        (),
        (
            "presence: ws-lamp offline keepalive-timeout\n",
            "$SYS/presence/ws-lamp online\n$SYS/presence/ws-lamp offline\n",
        ),
    ),
    # The documentation's own examples.
    (
        ("pump-4",),
        (),
        ("'reason': 'keepalive-timeout'", "'reason_code': 141, 'reason_code_name': 'keep-alive-timeout'}"),
    ),
    (("pytest.main",), (), ("1 passed",)),
    (("behind_proxy",), (), ("b'client 203.0.113.9, scheme https\\n'",)),
    (("add_canned_reply",), (), ("b'PONG\\n'\nb'heard hello\\n'\nanswered in the engine: 1\n",)),
]


@pytest.mark.parametrize("code", [code for _, code in EXAMPLES], ids=[name for name, _ in EXAMPLES])
def test_example_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    for markers, unless, lines in OUTPUTS:
        if all(m in code for m in markers) and not any(u in code for u in unless):
            for line in lines:
                assert line in done.stdout, (line, done.stdout)
    # Outputs checked whole, or by count.
    if "last_words" in code:
        assert done.stdout == "b'bye: idle\\n'\nb''\n"
    if "call_every" in code:
        assert done.stdout.count("every 100 ms") == 3
        assert done.stdout.count("once") == 1
    if "on_expire=expired" in code:
        assert done.stdout == "b''\n{'idle': 1}\n"
    if "MockClock" in code and "serve_tcp" in code:
        assert done.stdout == "closed after 30.0 s of virtual time\n"
    if "MockClock" in code and "meter-9" in code:
        assert re.fullmatch(r"offline 90\.[01] s after it came online\n", done.stdout), done.stdout
