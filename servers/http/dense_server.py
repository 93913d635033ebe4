"""The dense driver's server: the tasks its exchanges run in, and what a shutdown
does to its connections.

A dense connection (:class:`~.dense.HttpProtocol`) has no task of its own; only
while the app has a request does it need one. :class:`DenseHttpServer` hands each
new exchange to a :class:`Runner`, a task parked between exchanges, and keeps the
engine and the exchanges' nursery that :func:`~.dense.run_dense` opens for it.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

import outcome
import trio

import idlekeeper

from .asgi import ASGIApp
from .core import HttpConfig, HttpServer, Phase
from .exchange import Exchange
from .lifespan import Lifespan

__all__ = ["DenseHttpServer", "ExchangeHost", "Runner"]

# Runner tasks kept parked for the next exchange; beyond it they end.
_IDLE_RUNNERS = 256


class Runner:
    """A task that runs exchanges one after another, parked between them.

    Handing a parked runner the next exchange is one reschedule, where a task per
    request costs a spawn, a cancel scope and an exit (a tenth of a small request's
    CPU). Each exchange gets a fresh copy of the server's context, as a new task
    would, so context variables an app sets do not leak into the next request."""

    __slots__ = ("task", "scope", "exchange")

    def __init__(self, task: trio.lowlevel.Task, scope: trio.CancelScope) -> None:
        self.task = task
        self.scope = scope
        self.exchange: Exchange | None = None
        """The exchange this runner is running now, if any."""

    def cancel(self, exchange: Exchange) -> None:
        """Cancel ``exchange``'s app, if this runner is still running it."""
        if self.exchange is exchange:
            self.scope.cancel()


class ExchangeHost(Protocol):
    """A connection whose new exchange a runner is handed."""

    async def run_exchange(self, runner: Runner) -> None:
        """Run the connection's exchange just started, in ``runner``'s task."""
        ...


class DenseHttpServer(HttpServer):
    """The dense driver's server: one engine, and a nursery for the exchanges."""

    def __init__(
        self, app: ASGIApp, config: HttpConfig, keeper: idlekeeper.Keeper, lifespan: Lifespan | None = None
    ) -> None:
        super().__init__(app, config, keeper, lifespan)
        self.listening: idlekeeper.Engine | None = None
        """The engine serving the listeners, once :func:`~.dense.run_dense` has opened it."""
        self.exchanges: trio.Nursery
        """Where the runners run; opened by :func:`~.dense.run_dense`."""
        self._parked: list[Runner] = []
        self._context = contextvars.copy_context()

    def dispatch(self, conn: ExchangeHost) -> None:
        """Run ``conn``'s new exchange in a parked runner, or in a new one."""
        if self._parked:
            runner = self._parked.pop()
            runner.task.context = self._context.copy()
            trio.lowlevel.reschedule(runner.task, outcome.Value(conn))
        else:
            self.exchanges.start_soon(self._runner, conn)  # in a copy of this context

    async def _runner(self, conn: ExchangeHost) -> None:
        parked = self._parked
        with trio.CancelScope() as scope:
            runner = Runner(trio.lowlevel.current_task(), scope)

            def unpark(_: object) -> trio.lowlevel.Abort:
                parked.remove(runner)  # cancelled while parked: the server is cut
                return trio.lowlevel.Abort.SUCCEEDED

            while True:
                await conn.run_exchange(runner)
                if len(parked) >= _IDLE_RUNNERS:
                    return
                parked.append(runner)
                conn = await trio.lowlevel.wait_task_rescheduled(unpark)

    @property
    def engine(self) -> str:
        return "dense"

    def _stop_accepting(self) -> None:
        if self.listening is not None:
            self.listening.close_listeners()

    def _close_idle(self) -> None:
        for conn in list(self.connections):
            if conn.ws is not None:
                conn.ws.shut()  # close 1001: its app ends when the client answers
            elif conn.exchange is None and conn.phase is Phase.IDLE:
                conn.t.close()

    def _busy(self) -> bool:
        return any(conn.exchange is not None or conn.ws is not None for conn in self.connections)

    def _cut_all(self) -> None:
        self.exchanges.cancel_scope.cancel()
        for conn in list(self.connections):
            conn.t.abort()

    def _with_app(self, conn: Any) -> bool:
        return conn.exchange is not None or conn.ws is not None

    def _evict(self, conn: Any) -> None:
        conn.t.abort()
