"""The dense driver's server: the tasks its exchanges run in, and what a shutdown
does to its connections.

A dense connection (:class:`~.dense.HttpProtocol`) has no task of its own; only
while the app has a request does it need one. :class:`DenseHttpServer` queues each
new exchange for a :class:`Runner`, a task parked between exchanges, and keeps the
engine and the exchanges' nursery that :func:`~.dense.run_dense` opens for it.

One runner, the *taker*, runs the queued exchanges in turn, so a pass of the engine
that starts fifty requests wakes one task, not fifty. Each exchange's first step runs
at once inside the taker (:func:`_eagerly`): most apps answer without awaiting
anything that waits, and the exchange is over before the next is taken. The moment
an app does wait, the taker hands the rest of the queue to another runner before it
yields, so no request waits behind another's app.
"""

from __future__ import annotations

import collections
import contextvars
import types
from collections.abc import Coroutine, Generator
from typing import Any, Protocol

import trio

import idlekeeper

from .asgi import ASGIApp
from .core import HttpConfig, HttpServer, Phase
from .exchange import Exchange
from .lifespan import Lifespan

__all__ = ["DenseHttpServer", "ExchangeHost", "Runner"]

# Runner tasks kept parked for the next exchange; beyond it they end.
_IDLE_RUNNERS = 256
# Exchanges a taker runs before it lets the other tasks have a turn: exchanges whose
# apps never wait would otherwise hold trio's loop for as long as the queue lasts.
_TURN = 64


@types.coroutine
def _eagerly(coro: Coroutine[Any, Any, None], context: contextvars.Context, waits: Runner) -> Generator[Any, Any, None]:
    """Await ``coro`` in ``context``, its first step at once: if that step yields to
    trio (the app waits), ``waits.hand_on()`` is called first. From there on this is
    ``await coro``: trio's traps go up and what trio sends or throws goes down. (One
    difference: a walk of the task's awaits, ``Task.iter_await_frames``, stops at this
    frame, as it cannot see the coroutine driven from here.)"""
    try:
        trap = context.run(coro.send, None)
    except StopIteration:
        return
    waits.hand_on()
    while True:
        try:
            value = yield trap
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:
            try:
                trap = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                trap = coro.send(value)
            except StopIteration:
                return


class Runner:
    """A task that runs exchanges one after another, parked between them.

    Handing a parked runner the queue is one reschedule, where a task per request
    costs a spawn, a cancel scope and an exit (a tenth of a small request's CPU). Each
    exchange gets a fresh copy of the server's context, as a new task would, so
    context variables an app sets do not leak into the next request."""

    __slots__ = ("task", "scope", "exchange", "_server")

    def __init__(self, server: DenseHttpServer) -> None:
        self._server = server
        self.task: trio.lowlevel.Task
        """The runner's task, once it has started."""
        self.scope: trio.CancelScope
        """The scope its exchanges run in, once it has started."""
        self.exchange: Exchange | None = None
        """The exchange this runner is running now, if any."""

    def cancel(self, exchange: Exchange) -> None:
        """Cancel ``exchange``'s app, if this runner is still running it."""
        if self.exchange is exchange:
            self.scope.cancel()

    def hand_on(self) -> None:
        """The exchange this runner started waits: if it is the taker, another
        runner takes the queue from here."""
        self._server.hand_on(self)


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
        self._queued: collections.deque[ExchangeHost] = collections.deque()
        """New exchanges no runner has taken yet."""
        self._taker: Runner | None = None
        """The runner that takes the queue: woken, or running an exchange that has not
        waited yet. None while the queue is empty."""
        self._context = contextvars.copy_context()

    def dispatch(self, conn: ExchangeHost) -> None:
        """Queue ``conn``'s new exchange, and wake a runner to take the queue unless
        one is already its taker."""
        self._queued.append(conn)
        if self._taker is None:
            self._taker = self._wake()

    def hand_on(self, runner: Runner) -> None:
        """``runner``'s exchange waits: if it was the taker, the queue is another's."""
        if self._taker is runner:
            self._taker = self._wake() if self._queued else None

    def _wake(self) -> Runner:
        # The runner's next step starts in a fresh copy of the server's context, so
        # the exchange it takes first can be awaited as a task's own would be.
        if self._parked:
            runner = self._parked.pop()
            runner.task.context = self._context.copy()
            trio.lowlevel.reschedule(runner.task)
        else:
            runner = Runner(self)
            self._context.copy().run(self.exchanges.start_soon, self._runner, runner)
        return runner

    async def _runner(self, runner: Runner) -> None:
        parked, queued = self._parked, self._queued
        with trio.CancelScope() as scope:
            task = runner.task = trio.lowlevel.current_task()
            runner.scope = scope

            def unpark(_: object) -> trio.lowlevel.Abort:
                parked.remove(runner)  # cancelled while parked: the server is cut
                return trio.lowlevel.Abort.SUCCEEDED

            while True:
                fresh, turn = True, 0
                while queued and self._taker is runner:
                    if turn == _TURN:
                        fresh, turn = False, 0
                        await trio.lowlevel.cancel_shielded_checkpoint()
                        continue
                    turn += 1
                    conn = queued.popleft()
                    if fresh and not queued:
                        # Alone, in the context the step began in: awaited plainly,
                        # which costs less than eagerly. The queue is no longer this
                        # runner's, so an exchange started meanwhile wakes another.
                        self._taker = None
                        await conn.run_exchange(runner)
                    else:
                        context = task.context = self._context.copy()
                        await _eagerly(conn.run_exchange(runner), context, runner)
                    fresh = False
                if self._taker is runner:
                    self._taker = None
                if len(parked) >= _IDLE_RUNNERS:
                    return
                parked.append(runner)
                await trio.lowlevel.wait_task_rescheduled(unpark)

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
