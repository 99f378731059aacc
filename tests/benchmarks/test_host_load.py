"""The loaded host of the step benchmarks (host_load.py): busy processes that live only
inside their block, and a raised priority put back after it, or refused as a whole."""

import host_load


def test_busy_processes_run_inside_the_block_only():
    with host_load.busy_processes(2, settle_s=0.0) as procs:
        assert [p.poll() for p in procs] == [None, None]
    assert all(p.poll() is not None for p in procs)


def test_a_raised_priority_is_put_back_and_a_refusal_yields_none(monkeypatch):
    calls = []
    monkeypatch.setattr(host_load, "set_nice", lambda n: calls.append(n) or {7: 3})
    monkeypatch.setattr(host_load, "restore_nice", lambda was: calls.append(was))
    with host_load.raised_priority(-4) as got:
        assert got == -4 and calls == [-4]
    assert calls == [-4, {7: 3}]

    def refuse(n):
        raise PermissionError("nice -4: refused")

    monkeypatch.setattr(host_load, "set_nice", refuse)
    with host_load.raised_priority(-4) as got:
        assert got is None
    assert calls == [-4, {7: 3}]  # nothing to put back
