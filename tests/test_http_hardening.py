"""The HTTP server against hostile or unusual requests: smuggling, broken chunking,
``Expect: 100-continue``, foreign HTTP versions and absolute-form targets.

In-process under MockClock with raw sockets (timing is exact), plus one curl run
against the real process (wall clock) for the client that waits on ``100 Continue``.
"""

from __future__ import annotations

import logging
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from loadtest.processes import free_port, start_http
from servers.http.app import Request, Response
from servers.http.server import HttpConfig

from .test_http_server import GET, read_all, read_response, running

ROOT = Path(__file__).resolve().parent.parent
SMUGGLED = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` on a fresh connection; everything the server says until it closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(raw)
    return await read_all(stream)


async def still_serves(port: int) -> None:
    """A bad request ends only its own connection: a new one is served."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(GET)
    assert (await read_response(stream, bytearray())).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    ],
)
async def test_content_length_with_transfer_encoding_is_400_and_closes(clock: MockClock, framing: bytes) -> None:
    # Read as chunked, "0\r\n\r\n" ends the body and the GET after it is a second
    # request; a proxy that went by Content-Length would have forwarded it as body.
    raw = b"POST /echo HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n0\r\n\r\n" + SMUGGLED
    async with running() as (_, port):
        reply = await exchange(port, raw)
        assert reply.startswith(b"HTTP/1.1 400")
        assert reply.count(b"HTTP/1.1 ") == 1  # the smuggled request was not served
        await still_serves(port)


@pytest.mark.parametrize("lengths", [b"Content-Length: 5\r\nContent-Length: 6\r\n", b"Content-Length: 5, 6\r\n"])
async def test_differing_content_lengths_are_400(clock: MockClock, lengths: bytes) -> None:
    # h11 already refuses these; kept as a guard against an h11 upgrade that does not.
    async with running() as (_, port):
        reply = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\n" + lengths + b"\r\nhello" + SMUGGLED)
        assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1 ") == 1
        await still_serves(port)


@pytest.mark.parametrize("coding", [b"gzip", b"chunked, gzip", b"identity"])
async def test_transfer_encoding_not_ending_in_chunked_is_400(clock: MockClock, coding: bytes) -> None:
    # RFC 9112 §6.3: the body length cannot be known, so 400 and close (h11 says 501).
    raw = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding + b"\r\n\r\n0\r\n\r\n" + SMUGGLED
    async with running() as (_, port):
        reply = await exchange(port, raw)
        assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1 ") == 1
        await still_serves(port)


async def test_malformed_chunked_body_unread_by_the_app_is_400_with_one_log_line(
    clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="servers.http")
    caplog.set_level(logging.INFO, logger="idlekeeper")
    raw = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
    async with running() as (_, port):  # "/" never reads its body: the server drains it
        reply = await exchange(port, raw)
        assert reply.startswith(b"HTTP/1.1 400")
        await still_serves(port)
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a client's bad input"
    lines = [r.getMessage() for r in caplog.records if "chunk" in r.getMessage()]
    assert len(lines) == 1 and "400" in lines[0]


async def test_expect_100_continue_is_answered_when_the_app_reads_the_body(clock: MockClock) -> None:
    async with running(HttpConfig(body_timeout=5)) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        start = trio.current_time()
        interim = await client.receive_some()  # without a 100 this would be the 408
        assert interim.startswith(b"HTTP/1.1 100 ")
        assert trio.current_time() - start < 1
        await client.send_all(b"hello")
        buf = bytearray(interim.partition(b"\r\n\r\n")[2])
        assert (await read_response(client, buf)).endswith(b"\r\n\r\nhello")
        await client.send_all(GET)  # still a keep-alive connection
        assert (await read_response(client, buf)).startswith(b"HTTP/1.1 200")


async def test_expect_100_continue_is_not_invited_when_the_app_ignores_the_body(clock: MockClock) -> None:
    async with running() as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9000\r\nExpect: 100-continue\r\n\r\n")
        reply = await read_all(client)  # the final answer at once, then close: no body was wanted
        assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" in reply.lower()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_does_not_wait_for_its_expect_timeout(tmp_path: Path) -> None:
    body = tmp_path / "body"
    body.write_bytes(b"z" * 200_000)
    port = free_port()
    proc = start_http(port, cwd=str(ROOT))
    try:
        start = time.monotonic()
        # curl sends the body after --expect100-timeout if no 100 comes: 5 s makes a miss plain.
        command = ["curl", "-s", "--expect100-timeout", "5", "-H", "Expect: 100-continue", "--data-binary"]
        done = subprocess.run([*command, f"@{body}", f"http://127.0.0.1:{port}/echo"], capture_output=True, timeout=20)
        elapsed = time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert done.returncode == 0 and done.stdout == b"z" * 200_000
    assert elapsed < 3


@pytest.mark.parametrize("version", [b"HTTP/9.9", b"HTTP/2.0", b"HTTP/0.9"])
async def test_major_version_other_than_1_is_505(clock: MockClock, version: bytes) -> None:
    async with running() as (_, port):
        reply = await exchange(port, b"GET / " + version + b"\r\nHost: x\r\n\r\n" + SMUGGLED)
        assert reply.startswith(b"HTTP/1.1 505") and reply.count(b"HTTP/1.1 ") == 1
        await still_serves(port)


async def test_absolute_form_target_routes_by_its_path(clock: MockClock) -> None:
    seen: list[tuple[str, str, str | None]] = []

    async def app(request: Request) -> Response:
        seen.append((request.path, request.query, request.header("host")))
        return Response(200, [], b"ok")

    async with running(app=app) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        buf = bytearray()
        for target in (b"http://example.org:8080/healthz?a=1", b"HTTPS://example.org", b"/plain"):
            await client.send_all(b"GET " + target + b" HTTP/1.1\r\nHost: other\r\n\r\n")
            assert (await read_response(client, buf)).startswith(b"HTTP/1.1 200")
    # RFC 9112 §3.2.2: the target's authority replaces the Host header.
    assert seen == [("/healthz", "a=1", "example.org:8080"), ("/", "", "example.org"), ("/plain", "", "other")]


async def test_a_client_that_resets_mid_body_is_one_log_line_not_an_app_error(
    clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by ``python -m loadtest fuzz``: the reset reached the app as an exception
    from its body iterator and was logged as "http app raised", with a traceback."""
    caplog.set_level(logging.INFO, logger="servers.http")
    async with running() as (_, port):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        await sock.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nfirst part")
        await trio.sleep(0.5)  # the app is reading the body, waiting for the rest
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
        await trio.sleep(0.5)
        await still_serves(port)
    records = [r for r in caplog.records if r.name == "servers.http"]
    assert not [r for r in records if r.exc_info or "raised" in r.getMessage()], records
    assert [r for r in records if "went away" in r.getMessage() and "POST /echo" in r.getMessage()]


async def test_a_client_that_resets_before_its_100_continue_is_one_log_line(
    clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the full fuzz run: the reset surfaced in the ``100 Continue`` send."""
    caplog.set_level(logging.INFO, logger="servers.http")
    async with running() as (_, port):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, struct.pack("ii", 1, 0))
        # The head and the RST in one go: the server reads the head, then answers
        # 100 Continue into a connection that is already gone.
        await sock.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        sock.close()
        await trio.sleep(0.5)
        await still_serves(port)
    records = [r for r in caplog.records if r.name == "servers.http"]
    assert not [r for r in records if r.exc_info or "raised" in r.getMessage()], records
