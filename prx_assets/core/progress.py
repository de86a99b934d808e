"""Progress of a long step, reported as count, rate and ETA at a bounded rate.

Why: a 100k-image ``mds_shards`` or ``captions`` step runs for many minutes, and a user
watching the console or the Dagster UI's run logs must see that it moves and when it will
end. A runner calls :meth:`Progress.advance` as items finish; at most every ``every_s``
seconds (and once at the end) the line goes to ``report`` — the step's ``context.log.info``
in Dagster, so the same counts are in the UI's logs and, for ``register-batch``, on the
console. No Dagster import here: the runners stay pure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Report = Callable[[str], None]

#: Seconds between two progress lines of one step (and before the first one).
DEFAULT_EVERY_S = 10.0


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Progress:
    """``done`` of ``total`` items of one step (``total`` None: unknown, no ETA)."""

    def __init__(
        self,
        what: str,
        total: int | None,
        report: Report | None,
        every_s: float = DEFAULT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.report = what, total, report
        self.every_s, self.clock = every_s, clock
        self.done = 0
        self.started = clock()
        self._last = self.started
        self.lines = 0

    def line(self) -> str:
        """``what done/total (rate/s, ETA ...)``, as reported."""
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.done / elapsed
        if self.total is None:
            return f"{self.what} {self.done} ({rate:.1f}/s, {_duration(elapsed)})"
        text = f"{self.what} {self.done}/{self.total} ({rate:.1f}/s"
        if self.done >= self.total:
            return f"{text}, done in {_duration(elapsed)})"
        eta = (self.total - self.done) / rate if rate > 0 else None
        return f"{text}, ETA {_duration(eta) if eta is not None else 'unknown'})"

    def advance(self, n: int = 1) -> None:
        """``n`` more items done; reports when ``every_s`` passed since the last line."""
        self.done += n
        now = self.clock()
        if self.report is not None and now - self._last >= self.every_s:
            self._last = now
            self.lines += 1
            self.report(self.line())

    def finish(self, always: bool = False) -> None:
        """The last line: when an earlier one was reported, or ``always`` (a short step
        whose own summary line says the rest stays quiet otherwise)."""
        if self.report is not None and (self.lines or always):
            self.lines += 1
            self.report(self.line())


def no_progress(what: str = "", total: int | None = None) -> Progress:
    """A progress that reports nothing (the runners' default)."""
    return Progress(what, total, None)
