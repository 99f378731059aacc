"""The decode step on the device, per batch of `bench_step.py --model` (step_model.py):
what the GPU runs and how long it waits for the host.

- `queued_replay`: a CUDA graph's device time alone: `reps` replays, each between two
  events, queued behind a spin kernel that outlasts the host's launching of them all, so
  the host's launch cost never shows (median); and the host's time per launch.
- `device_times`: B requests decoding, then the captured step graph of the key their
  launch used (`ex.graphs.steps[key].graph`) alone, and the model's forward alone
  (`model.decode` on that step's inputs, captured in a graph of its own), each by
  `queued_replay`; and the model positions that forward reads, for the floor
  (step_floor.py), and the step's kernels split into forward, sampler and the rest
  (`step_parts`). Replaying the step graph advances the rows' positions on the device
  (by 2 * reps + 6); the requests are aborted after.

Everything that touches CUDA runs inside functions: the module imports on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from host_load import busy_processes, raised_priority
from step_events import StepEvents
from step_floor import floor_bytes, floor_us
from step_parts import step_parts

from graphexec.runtime.capture import GraphCapture

# ------------------------------------------------------------------ a graph alone


@functools.cache
def _spin_cycles_per_us() -> float | None:
    """Clock cycles per us of `torch.cuda._sleep` (its spin counts cycles); None where
    this torch has no such kernel."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / (a.elapsed_time(b) * 1e3)


def queued_replay(replay: Callable[[], object], reps: int) -> dict:
    """The device time of one `replay()` alone (module docstring): us = the median of
    `reps` replays queued behind a spin; gap_us: the largest device gap between them (near
    0 when the queue held); launch_us: host time per `replay()` call, unqueued."""
    replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        replay()
    launch_s = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]  # fmt: skip
    for a, b in pairs:  # made before the queue is filled
        a.record()
        b.record()
    rate = _spin_cycles_per_us()
    if rate is not None:  # the device spins while the host queues every replay
        torch.cuda._sleep(int((1.5 * launch_s * reps * 1e6 + 2000) * rate))
    for a, b in pairs:
        a.record()
        replay()
        b.record()
    pairs[-1][1].synchronize()
    times = [a.elapsed_time(b) * 1e3 for a, b in pairs]
    gaps = [pairs[i][1].elapsed_time(pairs[i + 1][0]) * 1e3 for i in range(reps - 1)]
    return dict(us=statistics.median(times), min_us=min(times), gap_us=max(gaps, default=0.0),
                launch_us=launch_s * 1e6, reps=reps, queued=rate is not None)  # fmt: skip


# ------------------------------------------------------------ the step, per batch


def admit_batch(ex, B: int, make, prompts: list[list[int]] | None, steps: int,
                mode: str | None = None, prefix: str = "b") -> None:  # fmt: skip
    """Admit B requests (`prefix`0 ..) that outlive `steps` more steps, then step until
    every one decodes, and twice more: the steady state."""
    prompts = prompts or [[1 + i % 100, 2, 3] for i in range(B)]
    # B long prompts take several steps' prefill budget: the first requests decode
    # meanwhile, and must not finish before the timed steps end
    warm = 3 + -(-sum(len(p) for p in prompts[:B]) // ex.config.prefill_budget)
    for i in range(B):
        ex.add_request(f"{prefix}{i}", prompts[i],
                       dataclasses.replace(make(i), max_tokens=steps + 30 + warm))  # fmt: skip
    for _ in range(warm):  # until every request decodes
        if len(ex.step(mode)) == B:
            break
    else:
        raise RuntimeError(f"{B} requests did not all decode in {warm} steps")
    for _ in range(2):  # warm steps
        ex.step(mode)


def end_batch(ex, B: int, prefixes: Sequence[str] = ("b",), mode: str | None = None) -> None:
    """Abort the batch's requests (any that are left) and step until the executor idles."""
    for p in prefixes:
        for i in range(B):
            ex.abort(f"{p}{i}")
    for _ in range(8):
        ex.step(mode)
        if ex.idle:
            return
    raise RuntimeError("the executor did not idle after its requests were aborted")


def step_inputs(ex, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, model positions, slot ids) of the step graph of `bucket` rows, as
    `StepFn.decode` gathers them from the slot table: fresh tensors, static for a graph."""
    slots = ex.runner.slots
    slot_ids = ex.runner.slot_ids[:bucket].clone()
    pos = slots.prompt_lens[slot_ids] + slots.positions[slot_ids] - 1
    return slots.last_token[slot_ids], pos, slot_ids


def device_times(ex, model, B: int, make, prompts, reps: int) -> dict:
    """The step graph alone and the forward alone at batch B (module docstring); the
    positions the forward reads (every row of the bucket, padding included)."""
    admit_batch(ex, B, make, prompts, 4, prefix="d")
    try:
        with StepEvents(ex, 2) as ev:
            for _ in range(2):
                ex.step()
        if len(ev.last_keys) != 1:
            raise RuntimeError(f"{B} rows ran as {len(ev.last_keys)} chunks, not one graph")
        key = ev.last_keys[0][0]
        captured = ex.graphs.steps.get(key)
        if captured is None or captured.graph is None:
            raise RuntimeError(f"{key} has no captured CUDA graph")
        torch.cuda.synchronize()
        graph = queued_replay(captured.graph.replay, reps)
        ids, pos, slot_ids = step_inputs(ex, key.bucket)
        fwd, _ = GraphCapture(ids.device)(lambda: model.decode(ids, pos, slot_ids))
        forward = queued_replay(fwd.replay, reps)
        try:  # a diagnosis: its failure leaves the timings
            parts = step_parts(captured.graph, fwd)
        except Exception as e:  # noqa: BLE001
            parts = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        positions = pos.clamp(min=0).tolist()
        del fwd
    finally:
        end_batch(ex, B, ("d",))
    return dict(key=str(key), graph=graph, forward=forward, positions=positions, parts=parts)


def idle_pass(measure, ex, B: int, make, steps: int, prompts, overlap: bool,
              blocking: bool | None = None, repeats: int = 1) -> dict:  # fmt: skip
    """The replayed step loop (`measure`) with EngineConfig.overlap set to `overlap` and,
    unless None, blocking_wait to `blocking` (the executor idles between passes, so the
    switch is clean): its idle and wall per step. `repeats` loops of `steps` each (under
    load a few multi-ms stalls make the mean): idle_us the mean over all their steps,
    idle_max_us the largest, the medians and p90 the median of the loops', the cycle their
    mean (`passes`: each loop's mean; one loop: its own values)."""
    was = ex.overlap, ex.runner.blocking_wait
    wait = was[1] if blocking is None else blocking
    ex.overlap, ex.runner.blocking_wait = overlap, wait
    try:
        ms = [measure(ex, B, make, steps, None, prompts=prompts) for _ in range(repeats)]
    finally:
        ex.overlap, ex.runner.blocking_wait = was
    ev = [m["events"] for m in ms]

    def med(k: str) -> float:
        return statistics.median(e[k] for e in ev)

    n = [e["steps"] - 1 for e in ev]  # idle gaps per loop
    return dict(overlap=overlap, blocking_wait=wait,
                idle_us=sum(e["idle_us"] * k for e, k in zip(ev, n, strict=True)) / sum(n),
                idle_median_us=med("idle_median_us"), idle_p90_us=med("idle_p90_us"),
                idle_max_us=max(e["idle_max_us"] for e in ev), busy_us=med("busy_us"),
                cycle_us=statistics.fmean(e["cycle_us"] for e in ev),
                steps=sum(e["steps"] for e in ev), repeats=repeats,
                passes=[e["idle_us"] for e in ev],
                wall_us=statistics.fmean(m["wall_us"] for m in ms),
                wall_p90_us=statistics.median(m["wall_p90_us"] for m in ms))  # fmt: skip


def device_section(r: dict, args, measure, ex, model, make, prompts, bandwidth: float) -> None:
    """Add the device measures to row `r` (its `replay` measured with the executor's own
    overlap setting, quiet): replay.graph_us / forward_us (alone), replay.idle (overlap
    on / off, and on with the other blocking_wait, quiet / beside `args.cpu_load` busy
    processes; loaded once more with this process at nice `args.engine_nice`, where the
    OS allows it) and replay.idle_us (their means), and the floor: floor_us,
    forward_over_floor. A failure is the row's `device_error`; its other results stay."""
    B, rp = r["batch"], r["replay"]
    try:
        mine = "on" if ex.overlap else "off"
        idle = {mine: dict(rp["events"], overlap=ex.overlap, wall_us=rp["wall_us"],
                           wall_p90_us=rp["wall_p90_us"])}  # fmt: skip
        idle["off" if ex.overlap else "on"] = idle_pass(measure, ex, B, make, args.steps,
                                                        prompts, not ex.overlap)  # fmt: skip
        # overlap on with the other wait (EngineConfig.blocking_wait): "on_block" or
        # "on_spin", quiet and loaded
        other = not ex.runner.blocking_wait
        tag = "_block" if other else "_spin"
        idle["on" + tag] = idle_pass(measure, ex, B, make, args.steps, prompts, True, other)
        if args.cpu_load:
            n = args.idle_repeats  # loaded: a few long stalls make the mean
            with busy_processes(args.cpu_load):
                for overlap in (True, False):
                    idle[("on" if overlap else "off") + "_loaded"] = idle_pass(
                        measure, ex, B, make, args.steps, prompts, overlap, repeats=n)
                idle["on_loaded" + tag] = idle_pass(measure, ex, B, make, args.steps,
                                                    prompts, True, other, n)  # fmt: skip
                if args.engine_nice:  # the stepping process above the load
                    with raised_priority(args.engine_nice) as nice:
                        if nice is not None:  # else refused: no row
                            idle["on_loaded_nice"] = dict(idle_pass(
                                measure, ex, B, make, args.steps, prompts, True, repeats=n),
                                nice=nice)  # fmt: skip
        for k, v in idle.items():
            v["cpu_load"] = args.cpu_load if "_loaded" in k else 0
        t = device_times(ex, model, B, make, prompts, args.replays)
    except Exception as e:  # the row keeps its replay and eager results
        r["device_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        with contextlib.suppress(Exception):
            end_batch(ex, B, ("b", "d"))
        return
    rp.update(graph_us=t["graph"]["us"], forward_us=t["forward"]["us"], graph=t["graph"],
              forward=t["forward"], key=t["key"], idle=idle, parts=t["parts"],
              idle_us={k: v["idle_us"] for k, v in idle.items()})  # fmt: skip
    fb = floor_bytes(model, t["positions"])
    r["floor"] = dict(fb, read_gb_s=bandwidth / 1e9, rows=len(t["positions"]),
                      mean_position=statistics.mean(t["positions"]))  # fmt: skip
    r["floor_us"] = floor_us(fb["floor_bytes"], bandwidth)
    r["forward_over_floor"] = rp["forward_us"] / r["floor_us"]


# ------------------------------------------------------------------------- report

HEAD = ("idle us on quiet/loaded", "idle us off quiet/loaded", "graph us", "forward us",
        "floor us", "forward/floor")  # fmt: skip


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def cells(r: dict) -> list[str]:
    """A row's cells under HEAD ("-" where not measured: no CUDA, or a device error)."""
    rp = r.get("replay", {})
    idle = rp.get("idle_us", {})
    pair = [f"{_us(idle.get(k))} / {_us(idle.get(k + '_loaded'))}" if k in idle else "-"
            for k in ("on", "off")]  # fmt: skip
    ratio = r.get("forward_over_floor")
    return [*pair, _us(rp.get("graph_us")), _us(rp.get("forward_us")), _us(r.get("floor_us")),
            f"{ratio:.2f}x" if ratio else "-"]  # fmt: skip


def summary(r: dict) -> str:
    """One printed line of a row's device measures."""
    if "device_error" in r:
        return f"failed: {r['device_error']}"
    rp, f = r["replay"], r["floor"]
    idle = ", ".join(f"{k} {v:.1f}" for k, v in rp["idle_us"].items())  # means
    parts = rp.get("parts", {})
    if "other" in parts:
        o, sm = parts["other"], parts["sampler"]
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(o["by_name"].items())[:4])
        split = (f"; sampler {sm['own_us']:.1f} us; other {o['own_us']:.1f} us + gaps "
                 f"{o['gap_us']:.1f} in {o['kernels']} kernels ({top})")  # fmt: skip
    else:
        split = f"; parts: {parts.get('error', 'not measured')}"
    return (
        f"graph {rp['graph_us']:9.1f} us, forward {rp['forward_us']:9.1f} us, floor "
        f"{r['floor_us']:9.1f} us ({f['floor_bytes'] / 1e9:.2f} GB) x"
        f"{r['forward_over_floor']:.2f}; idle us: {idle}{split}"
    )
