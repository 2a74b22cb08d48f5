"""Horovod's timeline of the Horovod layer's collectives, in Chrome's trace
format (open it in chrome://tracing or Perfetto), written by rank 0 of the
job as Horovod's coordinator writes it: one row per collective, named
``<kind>.<name>``; NEGOTIATE_<KIND> from its post until every rank has
posted it (the round that matched it), then <KIND> until it is waited on;
with ``mark_cycles``, CYCLE_START at every round of the matching.
``hvd.start_timeline(path)`` / ``hvd.stop_timeline()``, or HOROVOD_TIMELINE=path
at ``hvd.init()``; the file is written when the timeline stops (at the
latest when the program ends)."""

import atexit
import json
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .._base.description import Description

__all__ = ["start", "stop", "posted", "matched", "span", "cycle"]

Key = Tuple[str, str]


class _Recorder:
    """The events of one timeline, kept until it stops."""

    def __init__(self, path: str, mark_cycles: bool) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self.start_ns = time.time_ns()
        self.rows: Dict[str, int] = {}
        self.events: List[Dict[str, Any]] = [{
            "name": "start_time_since_epoch_in_micros", "ph": "M", "pid": 0,
            "args": {"start_time_since_epoch_in_micros": self.start_ns // 1000}}]

    def now(self) -> int:
        return (time.time_ns() - self.start_ns) // 1000

    def row(self, key: Key, description: Optional[Description]) -> int:
        kind = key[0] or (description.kind if description is not None else "collective")
        name = f"{kind}.{key[1]}"
        if name not in self.rows:
            self.rows[name] = len(self.rows) + 1
            self.events.append({"name": "process_name", "ph": "M", "pid": self.rows[name],
                                "args": {"name": name}})
        return self.rows[name]

    def mark(self, phase: str, key: Key, description: Optional[Description],
             activity: str = "") -> None:
        kind = (key[0] or (description.kind if description is not None else "")).upper()
        event: Dict[str, Any] = {"ph": phase, "ts": self.now(),
                                 "pid": self.row(key, description), "tid": 1}
        if phase == "B":
            event["name"] = activity + kind
        self.events.append(event)

    def write(self) -> None:
        with open(self.path, "w") as out:
            json.dump(self.events, out, indent=0)


_state: Dict[str, _Recorder] = {}


def start(path: str, mark_cycles: bool, writer: bool) -> None:
    """Record from now on into ``path`` (``writer``: this rank writes it;
    elsewhere nothing is recorded); a timeline already started is written first."""
    stop()
    if writer:
        _state["on"] = _Recorder(path, mark_cycles)


def stop() -> None:
    """Write the timeline (if one was started here) and stop recording."""
    recorder = _state.pop("on", None)
    if recorder is not None:
        recorder.write()


def posted(key: Key, description: Optional[Description]) -> None:
    recorder = _state.get("on")
    if recorder is not None:
        recorder.mark("B", key, description, "NEGOTIATE_")


def matched(key: Key, description: Optional[Description]) -> None:
    recorder = _state.get("on")
    if recorder is not None:
        recorder.mark("E", key, description)
        recorder.mark("B", key, description)


@contextmanager
def span(key: Key, description: Optional[Description]) -> Iterator[None]:
    """The wait that completes a started collective; its activity ends with it."""
    try:
        yield
    finally:
        recorder = _state.get("on")
        if recorder is not None:
            recorder.mark("E", key, description)


def cycle() -> None:
    recorder = _state.get("on")
    if recorder is not None and recorder.mark_cycles:
        recorder.events.append({"name": "CYCLE_START", "ph": "i", "s": "g",
                                "ts": recorder.now(), "pid": 0})


atexit.register(stop)
