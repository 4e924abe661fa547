# A timing callback for bench/scale.py: per task (play, role, name, start, end) and per host within
# each task (when the host was queued, when its result came back, what it was), written as JSON.
# Enabled only where asked for, never by the collection or ansible.cfg:
#   ANSIBLE_CALLBACK_PLUGINS=bench/callback_plugins ANSIBLE_CALLBACKS_ENABLED=meshkit_timing \
#   MESHKIT_TIMING_JSON=/tmp/t.json ansible-playbook ...
# The stdout callback (default) stays as it is, so the run's log reads as usual.
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: meshkit_timing
    type: aggregate
    short_description: Per-task and per-host timings of a playbook run, as JSON (bench/scale.py)
    description:
      - Records every task start (play, role, task name, action, file:line) and, per host, when the
        host's worker was queued (v2_runner_on_start) and when its result came back, with its status
        (ok, changed, failed, ignored, skipped, unreachable), loop items and retries.
      - Writes everything, with the recap's counts per host, when the playbook ends (v2_playbook_on_stats).
      - Times are seconds since the playbook started, on the controller's clock.
    requirements:
      - enabled in ANSIBLE_CALLBACKS_ENABLED
    options:
      output:
        description: Where to write the JSON. Unset, the callback records nothing.
        env:
          - name: MESHKIT_TIMING_JSON
        type: path
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "meshkit_timing"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._t0 = time.time()
        self._output: str | None = None
        self._playbooks: list[str] = []
        self._plays: list[dict[str, Any]] = []
        self._tasks: list[dict[str, Any]] = []
        self._by_uuid: dict[str, dict[str, Any]] = {}  # the latest start of each task

    def set_options(self, task_keys: Any = None, var_options: Any = None, direct: Any = None) -> None:
        super().set_options(task_keys=task_keys, var_options=var_options, direct=direct)
        self._output = self.get_option("output") or None

    def _now(self) -> float:
        return round(time.time() - self._t0, 4)

    # --- playbook, plays, tasks -----------------------------------------------------------------

    def v2_playbook_on_start(self, playbook: Any) -> None:
        self._playbooks.append(str(getattr(playbook, "_file_name", "") or ""))

    def v2_playbook_on_play_start(self, play: Any) -> None:
        self._plays.append({"name": play.get_name(), "start": self._now()})

    def _start(self, task: Any, handler: bool) -> None:
        role = getattr(task, "_role", None)
        entry: dict[str, Any] = {
            "index": len(self._tasks),
            "play": self._plays[-1]["name"] if self._plays else "",
            "role": role.get_name() if role is not None else None,
            "name": task.name or task.action,
            "action": task.action,
            "path": task.get_path() or "",
            "handler": handler,
            "start": self._now(),
            "end": None,
            "hosts": {},
        }
        self._tasks.append(entry)
        self._by_uuid[task._uuid] = entry

    def v2_playbook_on_task_start(self, task: Any, is_conditional: bool) -> None:
        self._start(task, handler=False)

    def v2_playbook_on_handler_task_start(self, task: Any) -> None:
        self._start(task, handler=True)

    # --- per host -------------------------------------------------------------------------------

    def _entry(self, task: Any) -> dict[str, Any]:
        entry = self._by_uuid.get(task._uuid)
        if entry is None:  # a result of a task whose start was not announced (should not happen)
            self._start(task, handler=False)
            entry = self._by_uuid[task._uuid]
        return entry

    def _host(self, task: Any, host: str) -> dict[str, Any]:
        return self._entry(task)["hosts"].setdefault(
            host, {"queued": None, "done": None, "status": None, "items": 0, "retries": 0}
        )

    def v2_runner_on_start(self, host: Any, task: Any) -> None:
        self._host(task, host.get_name())["queued"] = self._now()

    def _done(self, result: Any, status: str) -> None:
        now = self._now()
        record = self._host(result.task, result.host.get_name())
        record["done"] = now
        record["status"] = status
        entry = self._entry(result.task)
        entry["end"] = now if entry["end"] is None else max(entry["end"], now)

    def v2_runner_on_ok(self, result: Any) -> None:
        self._done(result, "changed" if result.result.get("changed") else "ok")

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        self._done(result, "ignored" if ignore_errors else "failed")

    def v2_runner_on_skipped(self, result: Any) -> None:
        self._done(result, "skipped")

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self._done(result, "unreachable")

    def _item(self, result: Any) -> None:
        self._host(result.task, result.host.get_name())["items"] += 1

    def v2_runner_item_on_ok(self, result: Any) -> None:
        self._item(result)

    def v2_runner_item_on_failed(self, result: Any) -> None:
        self._item(result)

    def v2_runner_item_on_skipped(self, result: Any) -> None:
        self._item(result)

    def v2_runner_retry(self, result: Any) -> None:
        self._host(result.task, result.host.get_name())["retries"] += 1

    # --- the end --------------------------------------------------------------------------------

    def v2_playbook_on_stats(self, stats: Any) -> None:
        if not self._output:
            return
        data = {
            "version": 1,
            "started": self._t0,
            "duration": self._now(),
            "playbooks": self._playbooks,
            "plays": self._plays,
            "tasks": self._tasks,
            "stats": {host: stats.summarize(host) for host in sorted(stats.processed)},
        }
        directory = os.path.dirname(os.path.abspath(self._output))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".timing-", suffix=".json")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; it is a log like the others
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1)
        os.replace(tmp, self._output)
