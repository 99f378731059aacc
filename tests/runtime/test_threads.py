"""`threads.set_nice`: every thread of the process at a nice value and each put back, or,
where the OS refuses any thread, none changed."""

import os
import threading

import pytest

from graphexec.runtime import threads

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux only")


def _nices() -> dict[int, int]:
    return {t: os.getpriority(os.PRIO_PROCESS, t) for t in threads._thread_ids()}


def test_every_thread_gets_the_nice_value_and_its_own_back():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        was = _nices()
        assert len(was) >= 2
        target = min(max(was.values()) + 2, 19)  # a lower priority: always allowed
        before = threads.set_nice(target)
        assert before == was and set(_nices().values()) == {target}
        threads.restore_nice(before)
        if os.geteuid() == 0:  # going back up needs the privilege
            assert _nices() == was
    finally:
        stop.set()
        worker.join()


def test_a_refusal_changes_nothing_and_says_why(monkeypatch):
    nice = {11: 0, 12: 0, 13: 0}  # a fake OS: three threads, the third refused

    def setpriority(which, who, value):
        if who == 13:
            raise PermissionError(1, "Operation not permitted")
        nice[who] = value

    monkeypatch.setattr(threads, "_thread_ids", lambda: [11, 12, 13])
    monkeypatch.setattr(threads.os, "getpriority", lambda which, who: nice[who])
    monkeypatch.setattr(threads.os, "setpriority", setpriority)
    with pytest.raises(PermissionError, match="nice -5: refused.*CAP_SYS_NICE"):
        threads.set_nice(-5)
    assert nice == {11: 0, 12: 0, 13: 0}
    monkeypatch.setattr(threads, "_thread_ids", lambda: [11, 12])  # none refused
    assert threads.set_nice(-5) == {11: 0, 12: 0} and nice == {11: -5, 12: -5, 13: 0}
