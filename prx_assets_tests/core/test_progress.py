"""Progress lines of long steps: count, rate and ETA, at a bounded rate."""

from prx_assets.core.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_reports_count_rate_and_eta_at_most_every_interval():
    clock, lines = Clock(), []
    p = Progress("b.000: rendered", 1000, lines.append, every_s=10, clock=clock)
    for _ in range(9):  # 9 s of 10 items/s: nothing yet
        clock.now += 1
        p.advance(10)
    assert lines == []
    clock.now += 1
    p.advance(10)  # 100 done in 10 s
    assert lines == ["b.000: rendered 100/1000 (10.0/s, ETA 1 min 30 s)"]
    clock.now += 5
    p.advance(50)  # 5 s later: not yet
    assert len(lines) == 1
    clock.now += 85
    p.advance(850)
    p.finish()
    assert lines[-1] == "b.000: rendered 1000/1000 (10.0/s, done in 1 min 40 s)"


def test_a_short_step_stays_quiet_unless_asked_and_an_unknown_total_has_no_eta():
    clock, lines = Clock(), []
    p = Progress("x", 3, lines.append, clock=clock)
    clock.now += 1
    p.advance(3)
    p.finish()
    assert lines == []  # its own summary line says the rest
    p.finish(always=True)
    assert lines == ["x 3/3 (3.0/s, done in 1 s)"]
    lines.clear()
    q = Progress("b: checked", None, lines.append, every_s=1, clock=clock)  # starts at 1 s
    clock.now += 2
    q.advance(40)
    assert lines == ["b: checked 40 (20.0/s, 2 s)"]
