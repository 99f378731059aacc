"""The device measures of `bench_step.py --model` (step_replay.py, step_floor.py) on the
CPU: the idle arithmetic from event stamps, the hook that stamps each launch (with fake
events on an emulated executor), the floor's bytes for a config, and the table's cells.
Their timing needs CUDA."""

import contextlib
import itertools
import types

from tests.interpreter import ensure_interpreter

ensure_interpreter()  # step_floor imports triton (floor_kernel): the interpreter first

import bench_step  # noqa: E402
import pytest
import step_events
import step_floor
import step_model
import step_replay
import torch

import graphexec as gx

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=300, bos_token_id=1,
            eos_token_id=2, max_position_embeddings=256)  # fmt: skip


def test_idle_is_the_gap_from_one_steps_end_to_the_next_ones_start():
    starts = [0.0, 110.0, 230.0, 330.0, 480.0]
    ends = [100.0, 200.0, 300.0, 400.0, 560.0]
    s = step_events.idle_stats(starts, ends)
    # gaps 10, 30, 30, 80; busy 100, 90, 70, 70, 80
    assert s["idle_us"] == 37.5 and s["idle_median_us"] == 30.0 and s["idle_max_us"] == 80.0
    assert s["idle_p90_us"] == pytest.approx(65.0)  # within the data: 30 + 0.7 * (80 - 30)
    assert s["busy_us"] == 80.0 and s["cycle_us"] == 120.0 and s["steps"] == 5
    assert s["split_gap_us"] is None and step_events.p90([7.0]) == 7.0


def test_a_split_steps_gap_moves_from_its_busy_time_to_the_idle_time():
    # the same stamps, steps 1 and 3 split, waiting 20 and 6 us between forward and draw
    s = step_events.idle_stats([0.0, 110.0, 230.0, 330.0, 480.0],
                               [100.0, 200.0, 300.0, 400.0, 560.0], [None, 20.0, None, 6.0, None])
    assert s["idle_us"] == pytest.approx((30 + 30 + 36 + 80) / 4) and s["idle_max_us"] == 80.0
    assert s["busy_us"] == 70.0 and s["split_gap_us"] == 13.0  # busy 100, 70, 70, 64, 80


@pytest.mark.parametrize("starts, ends, gaps", [
    ([0, 50], [40, 60, 70], None), ([0], [10], None), ([0, 30], [40, 60], None),
    ([0, 50], [40, 45], None), ([0, 50], [40, 60], [None]), ([0, 50], [40, 60], [None, 11]),
    ([0, 50], [40, 60], [-1, None]),
])  # fmt: skip
def test_idle_refuses_stamps_that_cannot_be_one_stream(starts, ends, gaps):
    with pytest.raises(ValueError):
        step_events.idle_stats(starts, ends, gaps)


class FakeEvent:
    """A timing event whose clock is the order of records (1 tick = 1 us)."""

    clock = itertools.count()

    def record(self):
        self.t = next(FakeEvent.clock)

    def synchronize(self):
        pass

    def elapsed_time(self, other):  # ms, as torch.cuda.Event's
        return (other.t - self.t) / 1e3


def executor(capture: bool, overlap: bool | None = None) -> gx.DecodeExecutor:
    ex = gx.DecodeExecutor(gx.models.TableModel(512, seed=0), max_batch_size=4, device="cpu",
                           buckets=[2, 4], overlap=overlap)  # fmt: skip
    if capture:  # emulated on the CPU: replay calls the recorded step
        ex.capture(progress=False)
    return ex


def greedy(i):
    return gx.SamplingParams(temperature=0.0, seed=i, ignore_eos=True)


@pytest.mark.parametrize("capture, mode", [(True, None), (False, None), (True, "eager")])
def test_each_launch_gets_one_start_before_its_step_and_one_end_after(capture, mode,
                                                                      one_thread):  # fmt: skip
    """Replayed (graphs.replay), replay without a graph (replay misses, then the step
    function) and eager (the step function): one start and one end per step, in stream
    order, the key of the last launch, and the runner as it was afterwards."""
    ex = executor(capture)
    step_replay.admit_batch(ex, 3, greedy, None, 10, mode)
    calls = []
    replay = ex.runner.graphs.replay
    ex.runner.graphs.replay = lambda key: calls.append(key) or replay(key)
    with step_events.StepEvents(ex, 4, event=FakeEvent) as ev:
        for _ in range(4):
            ex.step(mode)
    assert len(ev.starts) == len(ev.ends) == 4
    ticks = [e.t for pair in zip(ev.starts, ev.ends, strict=True) for e in pair]
    assert ticks == sorted(ticks)
    starts, ends, gaps = ev.times()
    s = step_events.idle_stats(starts, ends)
    assert gaps == [None] * 4 and starts[0] == 0.0 and s["split_gap_us"] is None
    assert min(v for v in s.values() if v is not None) >= 0
    ((key, first, rows),) = ev.last_keys
    assert (key.bucket, first, rows) == (4, 0, 3)
    assert len(calls) == (0 if mode == "eager" else 4)  # the wrapper called through
    assert "launch" not in vars(ex.runner) and "fn" not in vars(ex.runner)
    assert ex.runner.graphs.replay.__name__ == "<lambda>"  # ours, not the hook's
    step_replay.end_batch(ex, 3)
    assert ex.idle


@pytest.mark.parametrize("capture, mode", [(True, None), (False, None), (True, "eager")])
def test_a_split_step_is_stamped_at_its_forward_and_its_draw(capture, mode, one_thread):
    """Rows with bad words split each pipelined step (forward, the host's masks, draw):
    one start before the forward, one stamp after its launch, one before the draw and one
    end after it, in stream order; the gap between the middle two counts as idle."""
    ex = executor(capture, overlap=True)  # (the CPU's default is synchronous)
    bad = gx.SamplingParams(temperature=0.0, seed=1, ignore_eos=True, bad_words=((5, 6),))
    step_replay.admit_batch(ex, 3, lambda i: bad if i == 1 else greedy(i), None, 10, mode)
    before = ex.runner.split_steps
    with step_events.StepEvents(ex, 4, event=FakeEvent) as ev:
        for _ in range(4):
            ex.step(mode)
    assert ex.runner.split_steps - before == 4
    assert len(ev.starts) == len(ev.ends) == len(ev.gaps) == 4 and None not in ev.gaps
    ticks = [e.t for s, g, e in zip(ev.starts, ev.gaps, ev.ends, strict=True)
             for e in (s, *g, e)]  # fmt: skip
    assert ticks == sorted(ticks)
    starts, ends, gaps = ev.times()
    s = step_events.idle_stats(starts, ends, gaps)
    assert s["split_gap_us"] == pytest.approx(sum(gaps) / 4) and min(gaps) > 0
    assert s["idle_us"] > step_events.idle_stats(starts, ends)["idle_us"]
    for name in ("launch", "fn", "launch_forward", "launch_draw", "parts"):
        assert name not in vars(ex.runner)
    assert "replay_part" not in vars(ex.runner.graphs)
    step_replay.end_batch(ex, 3)
    assert ex.idle


def test_the_floor_counts_gemm_weights_lm_head_and_live_keys_and_values(one_thread):
    cfg = dict(step_model.resolve("llama-3.2-1b")[1], **TINY)
    model, _ = step_model.load(cfg, None, "cpu", torch.float32, 64)
    model.bind(3, "cpu")
    D, L, H, KV, hd, inter, V = 64, 2, 4, 2, 16, 128, 300
    per_layer = (H + 2 * KV) * hd * D + D * H * hd + 2 * inter * D + D * inter
    weights = (L * per_layer + V * D) * 4
    # rows at model positions 3, 9 and 0 read 4 + 10 + 1 keys and values in each layer
    kv = (4 + 10 + 1) * 2 * KV * hd * 4 * L
    assert step_floor.floor_bytes(model, [3, 9, 0]) == dict(
        weight_bytes=weights, kv_bytes=kv, floor_bytes=weights + kv
    )
    assert step_floor.floor_us(4_000_000, 2e12) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        step_floor.floor_us(1, 0.0)


def test_live_keys_are_clamped_to_the_cache_and_the_window():
    # max_seq_len 8: position 9 reads 8 keys, -1 one; a window of 4 keeps the last 4
    per = 2 * 3 * 5 * 2
    got = step_floor.kv_read_bytes([2, 9, -1], [None, 4], 8, 3, 5, 2)
    assert got == ((3 + 8 + 1) + (3 + 4 + 1)) * per


def test_cells_show_what_was_measured():
    r = dict(batch=8, replay=dict(graph_us=1510.4, forward_us=1402.0,
                                  idle_us=dict(on=3.2, off=180.0, on_loaded=41.0,
                                               off_loaded=260.6)),
             floor_us=700.0, forward_over_floor=2.002857)  # fmt: skip
    assert step_replay.cells(r) == ["3 / 41", "180 / 261", "1510", "1402", "700", "2.00x"]
    assert step_replay.cells(dict(batch=8, replay=dict(wall_us=5.0))) == ["-"] * 6
    quiet = dict(r, replay=dict(r["replay"], idle_us=dict(on=3.2, off=180.0)))
    assert step_replay.cells(quiet)[:2] == ["3 / -", "180 / -"]
    assert len(step_replay.cells(r)) == len(step_replay.HEAD)


def test_a_device_failure_keeps_the_rows_other_results(one_thread):
    ex = executor(False)

    def measure(*a, **k):
        raise RuntimeError("no device")

    r = dict(batch=2, replay=dict(wall_us=10.0, wall_p90_us=12.0, events=dict(idle_us=1.0)))
    args = types.SimpleNamespace(steps=2, cpu_load=0, replays=2)
    step_replay.device_section(r, args, measure, ex, None, greedy, None, 1e12)
    assert r["device_error"] == "RuntimeError: no device" and r["replay"]["wall_us"] == 10.0
    assert "floor_us" not in r and ex.idle and ex.overlap is False
    assert step_replay.summary(r) == "failed: RuntimeError: no device"


def test_steps_and_replays_must_leave_a_gap_to_measure():
    for bad in (["--steps", "1"], ["--replays", "1"], ["--cpu-load", "-1"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(["--model", "x", *bad])
    assert bench_step.parse_args(["--cpu-load", "0"]).cpu_load == 0


def test_a_rows_device_measures_land_in_its_json(monkeypatch, one_thread):
    """device_section's bookkeeping with the CUDA parts replaced: the other overlap
    quiet, both loaded (in that order, the executor's setting put back), the floor at
    the forward's positions and the ratio."""
    cfg = dict(step_model.resolve("llama-3.2-1b")[1], **TINY)
    model, _ = step_model.load(cfg, None, "cpu", torch.float32, 64)
    model.bind(3, "cpu")
    ex, seen = executor(False), []

    def measure(ex, B, make, steps, mode, prompts=None):
        seen.append((ex.overlap, ex.runner.blocking_wait, B, steps, mode))
        idle = (50.0 if ex.runner.blocking_wait else 100.0) if ex.overlap else 300.0
        idle += 6.0 * (len(seen) % 2)  # a loaded pass's two loops: 3 either side of the mean
        return dict(events=dict(idle_us=idle, idle_median_us=1.0, idle_p90_us=idle + 1,
                                idle_max_us=idle * 4, busy_us=9.0, cycle_us=idle + 9,
                                steps=steps),
                    wall_us=idle * 10, wall_p90_us=idle * 11)  # fmt: skip

    parts = dict(forward=dict(own_us=1390.0, gap_us=0.0, kernels=9),
                 sampler=dict(own_us=80.0, gap_us=0.0, kernels=2),
                 other=dict(own_us=25.0, gap_us=5.0, kernels=3, by_name={"_advance": 20.0}))
    times = dict(key="k", graph=dict(us=1500.0), forward=dict(us=1400.0), positions=[16, 20],
                 parts=parts)  # fmt: skip
    monkeypatch.setattr(step_replay, "device_times", lambda *a: dict(times))
    monkeypatch.setattr(step_replay, "busy_processes", lambda n: contextlib.nullcontext())
    nices = []

    @contextlib.contextmanager
    def raised(nice):
        nices.append(nice)
        yield nice

    monkeypatch.setattr(step_replay, "raised_priority", raised)
    assert ex.runner.blocking_wait is True  # EngineConfig's default
    r = dict(batch=2, replay=dict(measure(ex, 2, None, 5, None)))
    seen.clear()
    args = types.SimpleNamespace(steps=5, cpu_load=3, replays=4, engine_nice=-7,
                                 idle_repeats=2)  # fmt: skip
    seen.append(None)  # the quiet passes' idle: even count
    step_replay.device_section(r, args, measure, ex, model, greedy, None, 2e12)
    assert "device_error" not in r
    on, off, spin = (True, True, 2, 5, None), (False, True, 2, 5, None), (True, False, 2, 5, None)
    assert seen[1:] == [on, spin, on, on, off, off, spin, spin, on, on]
    assert nices == [-7]
    assert ex.overlap is False and ex.runner.blocking_wait is True
    rp = r["replay"]
    # loaded: two loops each, one of them 6 us more: their mean
    assert rp["idle_us"] == dict(off=306.0, on=50.0, on_spin=106.0, on_loaded=53.0,
                                 off_loaded=303.0, on_loaded_spin=103.0,
                                 on_loaded_nice=53.0)  # fmt: skip
    ld = rp["idle"]["on_loaded"]
    assert (ld["repeats"], ld["steps"], ld["passes"], ld["idle_max_us"]) == (2, 10, [50.0, 56.0],
                                                                             224.0)  # fmt: skip
    assert ld["idle_median_us"] == 1.0 and ld["wall_us"] == 530.0 and ld["cycle_us"] == 62.0
    one = rp["idle"]["on_spin"]  # one loop: its own values
    assert (one["repeats"], one["steps"], one["cycle_us"], one["passes"]) == (1, 5, 115.0, [106.0])
    keys = ("off", "on", "on_spin", "on_loaded", "off_loaded", "on_loaded_spin",
            "on_loaded_nice")  # fmt: skip
    assert [rp["idle"][k]["cpu_load"] for k in keys] == [0, 0, 0, 3, 3, 3, 3]
    assert [rp["idle"][k]["blocking_wait"] for k in keys[1:]] == [True, False, True, True,
                                                                  False, True]  # fmt: skip
    assert rp["idle"]["on_loaded_nice"]["nice"] == -7
    assert rp["idle"]["off"]["wall_us"] == 3060.0 and rp["idle"]["on"]["overlap"] is True
    assert (rp["graph_us"], rp["forward_us"]) == (1500.0, 1400.0)
    fb = step_floor.floor_bytes(model, [16, 20])
    assert r["floor"]["floor_bytes"] == fb["floor_bytes"] and r["floor"]["rows"] == 2
    assert r["floor_us"] == pytest.approx(fb["floor_bytes"] / 2e12 * 1e6)
    assert r["forward_over_floor"] == pytest.approx(1400.0 / r["floor_us"])
    assert "x" in step_replay.summary(r) and step_replay.cells(r)[0] == "50 / 53"
    assert rp["parts"] == parts
    assert "other 25.0 us + gaps 5.0 in 3 kernels" in step_replay.summary(r)


def test_step_parts_find_the_forward_and_split_the_sampler_from_the_rest() -> None:
    """The forward is the run of the forward graph's kernel names inside the step (a
    same-named kernel outside it is not the forward's); the sampler's Triton kernels by
    name; the rest (bookkeeping, copies) with their own and gap times."""
    import pytest
    from step_parts import split_step

    fwd = ["gemm", "norm", "gemm"]
    spans = [("_gather_kernel", 2, 2.0, 0.0), ("gemm", 5, 1.0, 1.5),  # not the forward
             ("gemm", 9, 9.0, 0.5), ("norm", 3, 3.0, 0.0), ("gemm", 9, 8.0, 0.0),
             ("_stats_kernel_0d1d", 4, 4.0, 2.0), ("_tail_kernel", 2, 2.0, 0.0),
             ("_advance_kernel", 1, 1.0, 3.0)]  # fmt: skip
    p = split_step(spans, fwd)
    assert p["forward"] == {"own_us": 20.0, "gap_us": 0.5, "kernels": 3}
    assert p["sampler"] == {"own_us": 6.0, "gap_us": 2.0, "kernels": 2}
    assert (p["other"]["own_us"], p["other"]["gap_us"], p["other"]["kernels"]) == (4.0, 4.5, 3)
    assert list(p["other"]["by_name"].items()) == [("_gather_kernel", 2.0), ("gemm", 1.0),
                                                  ("_advance_kernel", 1.0)]  # fmt: skip
    with pytest.raises(ValueError, match="not one run"):
        split_step(spans, ["norm", "norm"])
