"""Aggregate callback: at the end of a run, the slowest tasks with their seconds.

The VM tests enable it (ANSIBLE_CALLBACKS_ENABLED=task_timer) so a slow step under emulation
says which task cost the time.
"""

from __future__ import annotations

import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: task_timer
type: aggregate
short_description: print the slowest tasks at the end of a run
description: Times each task and handler; prints the ten slowest after the recap.
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_timer"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._times: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def _start(self, task) -> None:
        self._stop()
        self._current = (task.get_name(), time.monotonic())

    def _stop(self) -> None:
        if self._current:
            name, began = self._current
            self._times[name] = self._times.get(name, 0.0) + time.monotonic() - began
            self._current = None

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._start(task)

    def v2_playbook_on_handler_task_start(self, task):
        self._start(task)

    def v2_playbook_on_stats(self, stats):
        self._stop()
        total = sum(self._times.values())
        self._display.display(f"TASK TIMES (slowest of {len(self._times)}, {total:.0f} s in all):")
        for name, seconds in sorted(self._times.items(), key=lambda kv: -kv[1])[:12]:
            self._display.display(f"  {seconds:7.1f} s  {name}")
