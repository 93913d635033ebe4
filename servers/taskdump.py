"""What a worker is waiting on: its trio tasks, as a tree, each with where it waits.

``kill -USR1 <worker's PID>`` (or the supervisor's, which passes it on to every
worker) logs the tree at WARNING, like a JVM's thread dump: for a server that has
stopped doing something without an error, it shows which task waits where. The
server goes on serving.
"""

from __future__ import annotations

import logging
import os
import signal

import trio

__all__ = ["DUMP_SIGNAL", "dump_tasks_on_signal", "task_tree"]

logger = logging.getLogger("servers.taskdump")

DUMP_SIGNAL = signal.SIGUSR1
"""The signal that asks for the tree."""

_FRAMES = 8
"""Frames shown for each task, the innermost ones: where it waits, and what led there."""

_CORE = f"{os.sep}trio{os.sep}_core{os.sep}"


def task_tree(root: trio.lowlevel.Task) -> list[str]:
    """A line for ``root`` and each task under it (indented by depth): its name, then
    the frames it is suspended in, innermost first (``file:line function``)."""
    lines: list[str] = []

    def visit(task: trio.lowlevel.Task, depth: int) -> None:
        every = list(task.iter_await_frames())
        # trio's run loop's own frames (_core) say only "suspended": left out.
        frames = [
            f"{os.path.basename(f.f_code.co_filename)}:{lineno} {f.f_code.co_name}"
            for f, lineno in every
            if _CORE not in f.f_code.co_filename
        ]
        where = " <- ".join(reversed(frames[-_FRAMES:])) or ("(in trio's run loop)" if every else "(running)")
        lines.append(f"{'  ' * depth}{task.name}: {where}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                visit(child, depth + 1)

    visit(root, 0)
    return lines


async def dump_tasks_on_signal(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Log the task tree each time :data:`DUMP_SIGNAL` comes; started with
    ``nursery.start``, it listens once it has started."""
    with trio.open_signal_receiver(DUMP_SIGNAL) as signals:
        task_status.started()
        async for _ in signals:
            root = trio.lowlevel.current_root_task()
            tree = [] if root is None else task_tree(root)
            logger.warning("%d tasks, each with where it waits (SIGUSR1):\n%s", len(tree), "\n".join(tree))
