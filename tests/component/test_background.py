"""The one way the running guard runs threads (guard/engine/background.py): named daemon loops that end at
the stop, a failing round logged (and at debug only once stopping: no traceback on shutdown), delayed calls
on one timer thread in due order and none after the stop. Waits on the state it asserts about."""

from __future__ import annotations

import logging
import threading

from guard.engine.background import Background
from guard.lab.harness import eventually


def test_a_loop_runs_named_as_a_daemon_until_closed_and_close_waits_for_its_round():
    bg = Background()
    rounds: list[str] = []
    wake = threading.Event()
    thread = bg.loop("ghost-test-loop", lambda: rounds.append(threading.current_thread().name), 60.0,
                     what="the test loop", wake=wake, join=True)
    assert thread.daemon and thread.name == "ghost-test-loop"
    wake.set()  # a round now, not in 60 s
    eventually(lambda: rounds, 5, what="a round")
    bg.close(timeout=5.0)
    assert not thread.is_alive()  # the close woke it from its 60 s wait and waited for it
    assert rounds == ["ghost-test-loop"]


def test_a_failing_round_is_logged_and_the_loop_goes_on_but_once_stopping_only_at_debug(caplog):
    bg = Background(logging.getLogger("guard.test"))
    calls = []
    wake = threading.Event()
    in_round, release = threading.Event(), threading.Event()

    def step() -> None:
        calls.append(1)
        if len(calls) == 2:
            in_round.set()
            release.wait(5)  # the stop comes during this round
        raise RuntimeError(f"round {len(calls)}")

    with caplog.at_level(logging.DEBUG, logger="guard.test"):
        thread = bg.loop("ghost-test-fail", step, 0.01, what="the test round", wake=wake, join=True)
        eventually(in_round.is_set, 5, what="a second round after the first failed")
        closing = threading.Thread(target=bg.close, kwargs={"timeout": 5.0})
        closing.start()
        eventually(bg.stop.is_set, 5, what="the stop")
        release.set()
        closing.join(5)
    assert not thread.is_alive() and len(calls) == 2
    failed = [(r.levelno, r.getMessage(), r.exc_info is not None) for r in caplog.records if r.name == "guard.test"]
    assert failed == [(logging.ERROR, "the test round failed", True),
                      (logging.DEBUG, "the test round: round ended by the stop", True)]


def test_delayed_calls_run_in_due_order_on_one_timer_and_none_after_close():
    bg = Background()
    ran: list[str] = []
    bg.later(0.3, ran.append, "late")
    bg.later(0.0, ran.append, "now")
    bg.later(0.1, ran.append, "soon")
    eventually(lambda: len(ran) == 3, 5, what="the three delayed calls")
    assert ran == ["now", "soon", "late"]
    timers = [t for t in threading.enumerate() if t.name == "ghost-later"]
    assert len(timers) == 1  # one timer thread, not one per call
    bg.later(0.0, ran.append, "queued before the stop, due now")
    bg.later(3600, ran.append, "never")
    bg.close()
    bg.later(0.0, ran.append, "after the stop")
    eventually(lambda: not timers[0].is_alive(), 5, what="the timer thread to end")
    assert "never" not in ran and "after the stop" not in ran


def test_a_pool_is_named_and_its_queued_work_cancelled_at_close():
    bg = Background()
    pool = bg.pool("ghost-test-pool", 1)
    started, release = threading.Event(), threading.Event()
    names: list[str] = []

    def first() -> None:
        names.append(threading.current_thread().name)
        started.set()
        release.wait(5)

    running = pool.submit(first)
    eventually(started.is_set, 5, what="the pool's first task")
    queued = pool.submit(names.append, "queued")
    bg.close()
    release.set()
    running.result(5)
    assert queued.cancelled() and names == ["ghost-test-pool_0"]
