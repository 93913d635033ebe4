"""A small trio MQTT 3.1.1 client for the bridge benchmark, on the sans-IO
:class:`~servers.heartbeat.mqtt.client.ClientSession`: it reads in the background
(:meth:`Client.pump`), answers what needs answering and counts what came."""

from __future__ import annotations

import trio

from servers.heartbeat.mqtt.client import (
    MQTT_311,
    Acknowledged,
    ClientOptions,
    ClientSession,
    Connected,
    Message,
    Refused,
    Subscribed,
)


class Client:
    """One connection: messages by payload with their first arrival time, acknowledgements."""

    def __init__(self, name: str, clean: bool = True, window: int = 20) -> None:
        self.session = ClientSession(ClientOptions(name, MQTT_311, clean=clean, window=window))
        self.stream: trio.SocketStream | None = None
        self.arrived: dict[bytes, float] = {}
        """Payload: when it first came (``trio.current_time()``)."""
        self.by_topic: dict[str, list[tuple[bytes, float]]] = {}
        self.acked = 0
        self.closed = trio.Event()
        self._subscribed = trio.Event()
        self._progress = trio.Event()
        self._sending = trio.Lock()

    async def open(self, port: int, seconds: float = 10.0) -> None:
        with trio.fail_after(seconds):
            self.stream = await trio.open_tcp_stream("127.0.0.1", port)
            self.session.connect()
            await self.flush()
            while True:
                data = await self.stream.receive_some()
                if not data:
                    raise ConnectionError(f"port {port} closed the connection")
                for event in self.session.receive_data(data):
                    if isinstance(event, Refused):
                        raise ConnectionError(f"port {port} refused: {event.reason}")
                    if isinstance(event, Connected):
                        await self.flush()
                        return

    async def flush(self) -> None:
        """Send what the session queued; one sender at a time (the reader answers too)."""
        async with self._sending:
            data = self.session.bytes_to_send()
            if data and self.stream is not None:
                await self.stream.send_all(data)

    async def pump(self) -> None:
        """Read, answer and count until the connection ends."""
        assert self.stream is not None
        try:
            while data := await self.stream.receive_some(65536):
                now = trio.current_time()
                for event in self.session.receive_data(data):
                    if isinstance(event, Message):
                        self.arrived.setdefault(event.payload, now)
                        self.by_topic.setdefault(event.topic, []).append((event.payload, now))
                    elif isinstance(event, Acknowledged):
                        self.acked += 1
                    elif isinstance(event, Subscribed):
                        self._subscribed.set()
                await self.flush()
                self._progress.set()
                self._progress = trio.Event()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.closed.set()
            self._progress.set()

    async def subscribe(self, topic_filter: str, qos: int = 1, seconds: float = 10.0) -> None:
        """Subscribe and wait for the SUBACK (:meth:`pump` must be running)."""
        self._subscribed = trio.Event()
        self.session.subscribe([(topic_filter, qos)])
        await self.flush()
        with trio.fail_after(seconds):
            await self._subscribed.wait()

    async def room(self, queued: int, seconds: float) -> None:
        """Wait (bounded) until at most ``queued`` messages wait for the window."""
        with trio.move_on_after(seconds):
            while self.session.queued > queued and not self.closed.is_set():
                await self._progress.wait()

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None


async def connect(nursery: trio.Nursery, port: int, name: str, clean: bool = True, window: int = 20) -> Client:
    """A connected :class:`Client` with its :meth:`~Client.pump` running in ``nursery``."""
    client = Client(name, clean, window)
    await client.open(port)
    nursery.start_soon(client.pump)
    return client
