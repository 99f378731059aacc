"""The profile scenario of `bench_step.py` (`--scenario profile --model CONFIG`): where a
replayed decode forward's time goes, kernel by kernel, against the weight-read floor.

For each batch B (`--batches`, default 1 32): HFTransformer (random bf16 weights of the
config, the batch-invariant route, or cuBLAS's with `--cublas`) holds B slots of
`--prompt-len` cached tokens; its decode forward over B rows is captured in one CUDA
graph. Timed: the replay (CUDA events, median of `--steps`), and every kernel of it
under torch.profiler (CUPTI traces the graph's kernel nodes; median over 5 replays).

Each kernel is named by the op that launched it: one eager forward with every
`ForwardOps` function wrapped records the ops in order with the bytes each must move
(weights and activations read, outputs written; attention the keys and values of each
row's live positions); kernels are matched to ops in order by name (`OP_KERNELS`), and
the torch glue between them (embedding lookup, clamp, the logits' cast) is "other".
`--prefetch-k K [K ...]` profiles the same weights once per value of
`MatmulConfig.prefetch_k` (the weight columns each GEMM program asks L2 for before it
waits for the kernel before it): how much of a small layer's weight read can overlap
the kernels before it.
Per kernel: name, op, layer, time (start to end), own time (what it adds to the
replay's timeline: with dependent launches a kernel starts early and waits inside, so
its span overlaps the one before), gap, bytes, achieved GB/s; per op: count, time, own
time, bytes; kernels per layer; the gap (replay time minus the kernels' sum: launch
latency and bubbles between nodes).

The floor is the bytes the step must read (every weight it multiplies by, the LM head,
the live keys and values it attends to) at the read bandwidth measured in the same run
(step_floor.py: one Triton kernel reading a 2 GiB buffer once).

    python benchmarks/bench_step.py --scenario profile --model llama-3.2-1b [--batches 1 32]

Results: step-profile-<model>-<device>-<date>.json; a table per B printed last.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict

import torch
from bench_distributed import capture_graph, replay_us
from step_floor import floor_bytes, floor_us, read_bandwidth
from step_floor import nbytes as _nbytes

# the GEMM kernels' names (substrings): ours, cuBLAS's and CUTLASS's
GEMM_KERNELS = ("_linear_kernel", "_linear_tma_kernel", "gemm", "gemv", "Gemm", "cutlass",
                "splitK", "nvjet")  # fmt: skip
# which kernel names (substrings) each op launches, in order; anything else is "other"
OP_KERNELS = {
    "linear": GEMM_KERNELS,
    "linear_silu_mul": GEMM_KERNELS + ("_silu_mul_kernel",),
    "norm": ("_residual_rms_norm_kernel",),
    "rope_kv": ("_rope_kv_write_kernel",),
    "attend": ("_decode_attention_kernel",),
}


@dataclasses.dataclass
class OpCall:
    op: str  # qkv, o, gate_up, down, lm_head, norm, rope_kv, attention
    layer: int | None
    bytes: int
    kernels: tuple[str, ...]  # the name patterns of its kernels


def recording_ops(model, calls: list[OpCall]):
    """model.ops with every function wrapped to append an OpCall (for an eager forward)."""
    ops = model.ops
    names = {id(model.lm_head): ("lm_head", None)}
    for i, layer in enumerate(model.layers):
        for n in ("qkv", "o", "gate_up", "down"):
            names[id(getattr(layer, n))] = (n, i)

    def linear(x, w, bias=None, **kw):
        op, layer = names.get(id(w), ("linear", None))
        out = ops.linear(x, w, bias, **kw)
        calls.append(OpCall(op, layer, _nbytes(x, w, bias, out), OP_KERNELS["linear"]))
        return out

    def linear_silu_mul(x, w, **kw):
        op, layer = names.get(id(w), ("gate_up", None))
        out = ops.linear_silu_mul(x, w, **kw)
        calls.append(OpCall(op, layer, _nbytes(x, w, out), OP_KERNELS["linear_silu_mul"]))
        return out

    def qkv_rope(x, w, bias, pos, slots, cos, sin, kv, H):
        op, layer = names.get(id(w), ("qkv", None))
        out = ops.qkv_rope(x, w, bias, pos, slots, cos, sin, kv, H)
        M, KV, hd = x.shape[0], kv.shape[-2], kv.shape[-1]
        moved = _nbytes(x, w, bias, out) + M * 2 * KV * hd * kv.element_size()
        # the rotary kernel of its own only after a TMA tile (`matmul.linear_rope`)
        calls.append(OpCall(op, layer, moved, OP_KERNELS["linear"] + OP_KERNELS["rope_kv"]))
        return out

    def row_linear(x, w, split, bias=None, **kw):  # o / down (`row_parallel`): one GEMM
        op, layer = names.get(id(w), ("linear", None))
        out = ops.row_linear(x, w, split, bias, **kw)
        calls.append(OpCall(op, layer, _nbytes(x, w, bias, out), OP_KERNELS["linear"]))
        return out

    def norm(x, res, w, eps):
        h, r = ops.norm(x, res, w, eps)
        moved = _nbytes(x, res, w, h) + (_nbytes(r) if res is not None else 0)
        calls.append(OpCall("norm", None, moved, OP_KERNELS["norm"]))
        return h, r

    def rope_kv(qkv, pos, slots, cos, sin, kv, H):
        q = ops.rope_kv(qkv, pos, slots, cos, sin, kv, H)
        M, KV, hd = qkv.shape[0], kv.shape[-2], kv.shape[-1]
        written = M * 2 * KV * hd * kv.element_size()
        calls.append(OpCall("rope_kv", None, _nbytes(qkv, q) + written +
                            2 * M * hd * cos.element_size(), OP_KERNELS["rope_kv"]))  # fmt: skip
        return q

    def attend(q, kv, slots, positions, scale, window, config=None):
        out = ops.attend(q, kv, slots, positions, scale, window, config=config)
        live = (positions + 1).clamp(max=window or kv.shape[-3]).sum().item()
        kvb = live * 2 * kv.shape[-2] * kv.shape[-1] * kv.element_size()
        calls.append(OpCall("attention", None, _nbytes(q, out) + kvb, OP_KERNELS["attend"]))
        return out

    return dataclasses.replace(ops, linear=linear, linear_silu_mul=linear_silu_mul, norm=norm,
                               rope_kv=rope_kv, qkv_rope=qkv_rope, attend=attend,
                               row_linear=row_linear if ops.row_linear else None)  # fmt: skip


def assign_layers(calls: list[OpCall]) -> None:
    """A norm belongs to the layer of the GEMM after it; rotary and attention to the
    layer of the GEMM before them (the final norm: the LM head's, None)."""
    layer = None
    for c in reversed(calls):
        if c.op == "norm":
            c.layer = layer
        elif c.op not in ("rope_kv", "attention"):
            layer = c.layer
    for c in calls:
        if c.op in ("rope_kv", "attention"):
            c.layer = layer
        elif c.op != "norm":
            layer = c.layer


def label(kernels: list[str], calls: list[OpCall]) -> list[tuple[str, int | None, int]]:
    """(op, layer, bytes) per kernel, in launch order. Each op call starts at the next
    kernel matching its patterns and keeps the following ones that match them but do
    not start the next call (its bytes go on its first kernel); the rest is glue."""

    def hits(i: int, name: str) -> bool:
        return i < len(calls) and any(p in name for p in calls[i].kernels)

    out, i, started = [], 0, False
    for name in kernels:
        if started and hits(i, name) and not hits(i + 1, name):
            out.append((calls[i].op, calls[i].layer, 0))
            continue
        if started:
            i, started = i + 1, False
        if hits(i, name):
            out.append((calls[i].op, calls[i].layer, calls[i].bytes))
            started = True
        else:
            out.append(("other", None, 0))
    return out


def kernel_spans(g, reps: int = 5, before=None,
                 keep=None) -> list[tuple[str, float, float, float]]:  # fmt: skip
    """(name, us, own us, gap us) of each kernel of one replay, in launch order, each the
    median over `reps` replays. us: start to end. With programmatic dependent launch a
    kernel starts before the one before it ends and waits inside, so its us includes
    that wait; own us is what it adds to the stream's timeline (end - max(start, the end
    before)), and gap us the idle time before it (start - the end before, if positive):
    the own times and gaps add up to the replay. `before()` runs before each replay (an
    L2 flush, say) and `keep(name)` picks the replay's kernels from what else ran."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            g.replay()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_index >= 0
           and "Memcpy" not in e.name and "Memset" not in e.name
           and (keep is None or keep(e.name))]  # fmt: skip
    evs.sort(key=lambda e: e.time_range.start)
    n = len(evs) // reps
    if n * reps != len(evs):
        raise RuntimeError(f"{len(evs)} kernels traced over {reps} replays: not a multiple")
    spans = []  # per replay: [(us, own, gap)] of each kernel
    for r in range(reps):
        one, end = [], None
        for e in evs[r * n : (r + 1) * n]:
            t0, t1 = e.time_range.start, e.time_range.end
            own = t1 - (t0 if end is None else max(t0, end))
            gap = 0 if end is None else max(0, t0 - end)
            one.append((t1 - t0, max(own, 0), gap))
            end = t1 if end is None else max(end, t1)
        spans.append(one)
    med = statistics.median
    return [(evs[i].name, med(s[i][0] for s in spans), med(s[i][1] for s in spans),
             med(s[i][2] for s in spans)) for i in range(n)]  # fmt: skip


def profile_batch(model, B: int, prompt_len: int, steps: int, bandwidth: float) -> dict:
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(B)
    model.kv_cache.normal_(0, 1, generator=gen)
    ids = torch.randint(1, model.vocab_size, (B,), device=dev, generator=gen)
    pos = torch.full((B,), prompt_len, device=dev, dtype=torch.long)
    slots = torch.arange(B, device=dev)
    calls: list[OpCall] = []
    ops = model.ops
    model.ops = recording_ops(model, calls)
    model._forward(ids, pos, slots)
    model.ops = ops
    assign_layers(calls)
    torch.cuda.synchronize()
    g = capture_graph(lambda: model._forward(ids, pos, slots))
    g.replay()
    step = replay_us(g, steps)
    ks = kernel_spans(g)
    labels = label([n for n, *_ in ks], calls)
    kernels = [dict(name=n, op=op, layer=layer, us=us, own_us=own, gap_us=gap, bytes=b,
                    gb_s=b / us / 1e3 if b and us else None)
               for (n, us, own, gap), (op, layer, b) in zip(ks, labels, strict=True)]  # fmt: skip
    by_op: dict[str, dict] = defaultdict(lambda: dict(kernels=0, us=0.0, own_us=0.0, bytes=0))
    for k in kernels:
        d = by_op[k["op"]]
        d["kernels"] += 1
        d["us"] += k["us"]
        d["own_us"] += k["own_us"]
        d["bytes"] += k["bytes"]
    for d in by_op.values():
        d["gb_s"] = d["bytes"] / d["us"] / 1e3 if d["us"] and d["bytes"] else None
    read = sum(c.bytes for c in calls if c.op in ("qkv", "o", "gate_up", "down", "lm_head"))
    floor = floor_bytes(model, [prompt_len] * B)  # step_floor: weights, LM head, live KV
    floor_time = floor_us(floor["floor_bytes"], bandwidth)
    layered = [k for k in kernels if k["layer"] is not None]
    ksum = sum(k["us"] for k in kernels)
    del g
    return dict(batch=B, step_us=step, kernels_sum_us=ksum, gap_us=step - ksum,
                kernels_per_layer=len(layered) / model.num_layers, kernel_count=len(kernels),
                **floor, gemm_bytes=read, floor_us=floor_time,
                step_over_floor=step / floor_time, by_op=dict(by_op),
                kernels=kernels)  # fmt: skip


def markdown(result: dict) -> str:
    lines = []
    for r in result["rows"]:
        pk = f", prefetch_k {r['prefetch_k']}" if "prefetch_k" in r else ""
        lines += [f"{result['model']} ({result['route']}{pk}), B = {r['batch']}: step "
                  f"{r['step_us']:.0f} us, kernels {r['kernels_sum_us']:.0f} us, gaps "
                  f"{r['gap_us']:.0f} us, floor {r['floor_us']:.0f} us "
                  f"({r['floor_bytes'] / 1e9:.2f} GB at {result['read_gb_s']:.0f} GB/s): "
                  f"{r['step_over_floor']:.2f}x; {r['kernels_per_layer']:.1f} kernels a layer",
                  "", "| op | kernels | us | own us | share (own) | GB | GB/s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for op, d in sorted(r["by_op"].items(), key=lambda kv: -kv[1]["us"]):
            gbs = f"{d['gb_s']:.0f}" if d["gb_s"] else "-"
            own = d.get("own_us")
            share = f"{own / r['step_us']:.0%}" if own is not None else "-"
            own = f"{own:.0f}" if own is not None else "-"
            lines.append(f"| {op} | {d['kernels']} | {d['us']:.0f} | {own} | {share} | "
                         f"{d['bytes'] / 1e9:.3f} | {gbs} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def run(args, header: dict, resolve, load, dtypes) -> tuple[str, dict]:
    """The scenario: one model (`--model` through step_model's resolve/load), each B of
    --batches (default 1 32); the JSON's path and the result."""
    import json
    import os

    from graphexec.kernels.matmul_config import MatmulConfig

    name, cfg, folder = resolve(args.model)
    batches = args.batches or [1, 32]
    need = args.prompt_len + 8
    bandwidth = read_bandwidth(args.device)
    route = "cublas" if args.cublas else "invariant"
    rows = []
    for pk in args.prefetch_k or [None]:  # one model per value, the same seeded weights
        matmul = MatmulConfig.default()
        matmul = matmul if pk is None else matmul.replace(prefetch_k=pk)
        model, _ = load(cfg, folder, args.device, dtypes[args.dtype], max(need, 64),
                        args.seed, batch_invariant=not args.cublas, matmul=matmul)  # fmt: skip
        model.bind(max(batches) + 1, args.device)
        for B in batches:
            row = profile_batch(model, B, args.prompt_len, args.steps, bandwidth)
            rows.append(dict(row, prefetch_k=matmul.prefetch_k))
        del model
        torch.cuda.empty_cache()
    result = dict(header, scenario="profile", model=name, route=route, dtype=args.dtype,
                  prompt_len=args.prompt_len, read_gb_s=bandwidth / 1e9, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    dev = header["device"].lower().replace(" ", "-")
    tag = f"{name}-cublas" if args.cublas else name
    path = os.path.join(args.out, f"step-profile-{tag}-{dev}-{header['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path, result
