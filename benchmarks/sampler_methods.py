"""The methods `bench_sampler.py` times: the read floor, graphexec, FlashInfer, torch-native.

METHODS names and describes each method; BUILDERS[name](case) prepares one on a Case (static
[B, V] logits on a device) and returns a Bench whose fn() is one call. Every sampler uses
per-row parameter tensors: temperature 0.8, top-k 50, top-p 0.9, min-p 0.05, a seed per
row. `floor.read` is the measured floor: a kernel that reads every logit once and writes
each row's max (`floor_kernel.py`), timed like the samplers. graphexec, FlashInfer and
Triton are imported on first use, so this module imports with torch alone. The logits
shapes are in `sampler_shapes.py`, the timing protocol (`Timer`: the L2 flushed by reading
before every call, the instruction caches evicted) in `sampler_timing.py`; both are
re-exported here. run_method(name, case, Timer(...), first_call) times one method on one
case, eagerly and as a CUDA-graph replay, and returns its results row.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sampler_shapes import (  # noqa: F401  (re-exported)
    MIN_P,
    NUM_LOGPROBS,
    REAL,
    REAL_V,
    SHAPES,
    SWEEP,
    SWEEP_TOP_P,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    make_logits,
)
from sampler_shapes import row_top_p as _row_top_p
from sampler_timing import FLUSH_BYTES, Timer, check_tokens, error_text  # noqa: F401

FLOOR = "floor.read"

METHODS = {
    FLOOR: "the read floor: floor_kernel.RowMax, one launch that reads every logit once and "
    "writes each row's max (torch.amax where Triton cannot run)",
    "graphexec.no_filter": "sample_step, temperature only (variant no_filter)",
    "graphexec.top_k_top_p": "sample_step, temperature + top-k + top-p (variant top_k_top_p)",
    "graphexec.top_p": "sample_step, temperature + top-p, no top-k (variant default)",
    "graphexec.min_p": "sample_step, temperature + min-p 0.05 (variant default)",
    "graphexec.mixed": "sample_step, rows cycling top-k + top-p / top-p / min-p (variant "
    "default with top-k rows)",
    "graphexec.top_k_top_p+logprobs20": "graphexec.top_k_top_p with logprobs=20 on every row",
    "graphexec.top_k_top_p+bitmask": "graphexec.top_k_top_p with a random int32 bitmask "
    "allowing ~50% of tokens",
    "flashinfer.sampling_from_logits": "flashinfer.sampling.sampling_from_logits (no temperature)",
    "flashinfer.top_k_top_p_from_logits": "flashinfer.sampling.top_k_top_p_sampling_from_logits, "
    "per-row k/p tensors, top_k_first (no temperature)",
    "flashinfer.cake": "flashinfer.sampling.softmax(temperature) + flashinfer.cake_sampling."
    "top_k_top_p_sampling_from_probs (top_k_max=50); 'note' gives its route",
    "flashinfer.top_p": "flashinfer.sampling.softmax(temperature) + top_p_sampling_from_probs",
    "flashinfer.min_p": "flashinfer.sampling.softmax(temperature) + min_p_sampling_from_probs",
    "torch.sort_top_k_top_p": "temperature, sort, top-k then top-p mask, scatter back, softmax, "
    "exponential race argmax(probs / Exp(1)) (vLLM forward_native)",
    "torch.no_filter": "softmax(logits / T), exponential race argmax(probs / Exp(1))",
}


@dataclass
class Case:
    logits: torch.Tensor  # [B, V] static input
    B: int
    V: int
    device: torch.device
    gx_backend: str
    shape: str = ""  # the logits' shape (SHAPES, SWEEP or REAL)
    sampler_config: dict = dataclasses.field(default_factory=dict)  # SamplerConfig overrides


def row_top_p(c: Case) -> torch.Tensor:
    """[B] f32 top-p of the case's rows: TOP_P, or SWEEP_TOP_P cycled on sweep shapes."""
    return _row_top_p(c.shape, c.B, c.device)


@dataclass
class Bench:
    fn: Callable[[], torch.Tensor]  # one sampler call; returns the sampled ids
    note: str | None = None
    tokens: bool = True  # fn returns token ids (checked to lie in [0, V))


# ----------------------------------------------------------------------------- methods


def _floor_read(c: Case) -> Bench:
    """The Triton kernel on CUDA and with the triton backend (on the CPU: the interpreter);
    torch.amax elsewhere (a CPU smoke run; the row's note says so)."""
    if c.device.type == "cuda" or c.gx_backend == "triton":
        from floor_kernel import RowMax

        row_max = RowMax(c.B, c.V, c.logits.dtype, c.device)
        note = f"{row_max.num_slices} slices of {row_max.slice} logits a row"
        return Bench(lambda: row_max(c.logits), note=note, tokens=False)
    out = torch.empty(c.B, dtype=c.logits.dtype, device=c.device)
    note = "torch.amax (no Triton here: --gx-backend triton runs the kernel)"
    return Bench(lambda: torch.amax(c.logits, dim=1, out=out), note=note, tokens=False)


def _gx(variant_params: dict | tuple[dict, ...], num_top: int | None = None,
        bitmask: bool = False):  # fmt: skip
    """A graphexec method: every row with `variant_params`, or row b with the b-th of a
    tuple of them, cycled."""
    cycle = variant_params if isinstance(variant_params, tuple) else (variant_params,)

    def build(c: Case) -> Bench:
        import graphexec as gx
        from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

        params = [gx.SamplingParams(seed=1000 + b, **cycle[b % len(cycle)]) for b in range(c.B)]
        # each top-p row's own top-p (mixed on sweep shapes)
        params = [dataclasses.replace(p, top_p=t) if p.top_p < 1.0 else p for p, t in
                  zip(params, row_top_p(c).tolist(), strict=True)]  # fmt: skip
        table = SamplingTensors.from_params(params, c.V, c.device)
        out = SamplerOutput.allocate(c.B, c.device, num_top)
        ws = cfg = None
        if c.gx_backend == "triton":  # persistent scratch, as the executor's
            from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

            cfg = SamplerConfig.default().replace(**c.sampler_config)
            ws = Workspace.allocate(c.B, c.V, c.device, cfg, num_top is not None)
        slot_ids = torch.arange(c.B, device=c.device)
        positions = torch.arange(c.B, device=c.device) + 7
        bm = None
        if bitmask:  # random bits: each token allowed with probability 1/2
            g = torch.Generator().manual_seed(1)
            words = torch.randint(0, 2**32, (c.B, (c.V + 31) // 32), generator=g)
            bm = words.to(torch.int32).to(c.device)
        variant = gx.choose_variant(params)

        def fn() -> torch.Tensor:
            gx.sample_step(c.logits, slot_ids, positions, table, out, bm, variant, c.gx_backend,
                           config=cfg, workspace=ws)  # fmt: skip
            return out.token_ids

        return Bench(fn, note=None)

    return build


def _flashinfer(name: str):
    if name == "cake_sampling":
        import flashinfer.cake_sampling as mod
    else:
        import flashinfer.sampling as mod
    return mod


def _fi_rng(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    seed = torch.arange(1000, 1000 + c.B, dtype=torch.int64, device=c.device)
    return seed, torch.full((c.B,), 7 << 16, dtype=torch.int64, device=c.device)


def _fi_sampling_from_logits(c: Case) -> Bench:
    fs = _flashinfer("sampling")
    seed, offset = _fi_rng(c)
    return Bench(lambda: fs.sampling_from_logits(c.logits, seed=seed, offset=offset))


def _fi_top_k_top_p(c: Case) -> Bench:
    fs = _flashinfer("sampling")
    seed, offset = _fi_rng(c)
    k = torch.full((c.B,), TOP_K, dtype=torch.int32, device=c.device)
    p = row_top_p(c)
    return Bench(
        lambda: fs.top_k_top_p_sampling_from_logits(c.logits, k, p, seed=seed, offset=offset)
    )


def _fi_cake(c: Case) -> Bench:
    fs, cs = _flashinfer("sampling"), _flashinfer("cake_sampling")
    t = torch.full((c.B,), TEMPERATURE, dtype=torch.float32, device=c.device)
    k = torch.full((c.B,), TOP_K, dtype=torch.int32, device=c.device)
    p = row_top_p(c)

    def fn() -> torch.Tensor:
        probs = fs.softmax(c.logits, temperature=t)
        return cs.top_k_top_p_sampling_from_probs(
            probs, k, p, top_k_max=TOP_K, philox_seed=1234, philox_offset=7 << 16
        )

    try:
        route = cs.cake_sampling_route(fs.softmax(c.logits, temperature=t), k, TOP_K)
    except Exception as e:  # the route is informative only
        route = f"route unknown: {type(e).__name__}: {e}"
    return Bench(fn, note=f"cake route: {route}")


def _fi_from_probs(kind: str):
    def build(c: Case) -> Bench:
        fs = _flashinfer("sampling")
        seed, offset = _fi_rng(c)
        t = torch.full((c.B,), TEMPERATURE, dtype=torch.float32, device=c.device)
        if kind == "top_p":
            arg, sample = row_top_p(c), fs.top_p_sampling_from_probs
        else:
            arg, sample = torch.full((c.B,), MIN_P, device=c.device), fs.min_p_sampling_from_probs

        def fn() -> torch.Tensor:
            probs = fs.softmax(c.logits, temperature=t)
            return sample(probs, arg, seed=seed, offset=offset)

        return Bench(fn)

    return build


def _torch_sort_top_k_top_p(c: Case) -> Bench:
    inv_t = torch.full((c.B, 1), 1.0 / TEMPERATURE, device=c.device)
    k = torch.full((c.B, 1), TOP_K, dtype=torch.int64, device=c.device)
    p = row_top_p(c).view(-1, 1)

    def fn() -> torch.Tensor:
        x = c.logits.float() * inv_t
        sv, si = x.sort(dim=-1, descending=False)
        kth = sv.gather(1, (c.V - k).clamp(min=0))  # k-th largest value
        sv = sv.masked_fill(sv < kth, -torch.inf)
        cum = sv.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[:, -1] = False  # always keep the most likely token
        sv = sv.masked_fill(drop, -torch.inf)
        probs = torch.empty_like(sv).scatter_(1, si, sv).softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        return probs.div_(q).argmax(dim=-1)

    return Bench(fn)


def _torch_no_filter(c: Case) -> Bench:
    inv_t = torch.full((c.B, 1), 1.0 / TEMPERATURE, device=c.device)

    def fn() -> torch.Tensor:
        probs = (c.logits.float() * inv_t).softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        return probs.div_(q).argmax(dim=-1)

    return Bench(fn)


_T = dict(temperature=TEMPERATURE)
BUILDERS: dict[str, Callable[[Case], Bench]] = {
    FLOOR: _floor_read,
    "graphexec.no_filter": _gx(_T),
    "graphexec.top_k_top_p": _gx(dict(_T, top_k=TOP_K, top_p=TOP_P)),
    "graphexec.top_p": _gx(dict(_T, top_p=TOP_P)),
    "graphexec.min_p": _gx(dict(_T, min_p=MIN_P)),
    "graphexec.mixed": _gx(
        (dict(_T, top_k=TOP_K, top_p=TOP_P), dict(_T, top_p=TOP_P), dict(_T, min_p=MIN_P))
    ),
    "graphexec.top_k_top_p+logprobs20": _gx(
        dict(_T, top_k=TOP_K, top_p=TOP_P, logprobs=NUM_LOGPROBS), num_top=NUM_LOGPROBS
    ),
    "graphexec.top_k_top_p+bitmask": _gx(dict(_T, top_k=TOP_K, top_p=TOP_P), bitmask=True),
    "flashinfer.sampling_from_logits": _fi_sampling_from_logits,
    "flashinfer.top_k_top_p_from_logits": _fi_top_k_top_p,
    "flashinfer.cake": _fi_cake,
    "flashinfer.top_p": _fi_from_probs("top_p"),
    "flashinfer.min_p": _fi_from_probs("min_p"),
    "torch.sort_top_k_top_p": _torch_sort_top_k_top_p,
    "torch.no_filter": _torch_no_filter,
}
assert list(BUILDERS) == list(METHODS)


def pick_methods(spec: str | None, methods, defaults) -> list[str]:
    """--methods of a benchmark: a comma list; a token naming one of `methods` exactly
    selects it, else every one of `defaults` containing it. None: `defaults`. In the
    order of `methods`."""
    if not spec:
        return list(defaults)
    chosen: set[str] = set()
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        hits = [tok] if tok in methods else [m for m in defaults if tok in m]
        if not hits:
            raise SystemExit(f"--methods: {tok!r} matches none of {list(methods)}")
        chosen.update(hits)
    return [m for m in methods if m in chosen]


def select_methods(spec: str | None) -> list[str]:
    """Comma list; a token naming a method exactly selects it, else every method containing it."""
    return pick_methods(spec, METHODS, METHODS)


# ----------------------------------------------------------------------------- one method's row


def blank_row(method: str, B: int, V: int, dtype: str) -> dict:
    return dict(method=method, B=B, V=V, dtype=dtype, eager_us=None, graph_us=None, floor_us=None)


def profile_kernels(graph, timer: Timer, reps: int = 5) -> list[dict]:
    """The sampler kernels of one replay of `graph`, each prepared as a timed call is
    (`Timer.prepare`): name, us and own us (`step_profile.kernel_spans`), medians."""
    from step_parts import SAMPLER_KERNELS
    from step_profile import kernel_spans

    def keep(name: str) -> bool:
        return any(name.startswith(k) for k in SAMPLER_KERNELS)

    return [dict(name=n, us=round(us, 2), own_us=round(own, 2))
            for n, us, own, _ in kernel_spans(graph, reps, timer.prepare, keep)]  # fmt: skip


def run_method(name: str, case: Case, timer: Timer, first_call: dict,
               profile: bool = False) -> dict:  # fmt: skip
    """One JSON row; never raises (except KeyboardInterrupt). `profile`: a graphexec
    method's row gets its kernels' times too (`profile_kernels`)."""
    row = blank_row(name, case.B, case.V, str(case.logits.dtype)[6:])
    if name.startswith("flashinfer.") and not timer.cuda:
        row["error"] = "FlashInfer needs CUDA"
        return row
    if name not in first_call and name.startswith("flashinfer."):
        print(
            f"  first call of {name}: FlashInfer may JIT-build its module now "
            "(minutes on a fresh host)",
            flush=True,
        )
    try:
        t0 = time.perf_counter()
        bench = BUILDERS[name](case)
        if bench.note:
            row["note"] = bench.note
        tok = bench.fn()
        if timer.cuda:
            torch.cuda.synchronize(case.device)
        first_call.setdefault(name, round(time.perf_counter() - t0, 3))
        bad = check_tokens(tok, case.V) if bench.tokens else None
        if bad:
            row["warning"] = f"eager: {bad}"
        for _ in range(2):
            bench.fn()
        row["eager_us"] = round(timer.time(bench.fn, sync_each=True), 2)
    except Exception as e:
        row["error"] = error_text(e)
        traceback.print_exc(limit=3)
        return row
    if not timer.cuda:
        return row
    graph = None
    try:
        graph, result = timer.capture(bench.fn)
        bad = check_tokens(result, case.V) if bench.tokens else None
        if bad:
            row["warning"] = f"{row.get('warning', '')} graph: {bad}".strip()
        row["graph_us"] = round(timer.time(graph.replay, sync_each=False), 2)
        if profile and name.startswith("graphexec."):
            row["kernels"] = profile_kernels(graph, timer)
    except Exception as e:
        row["error"] = "graph capture/replay: " + error_text(e)
        traceback.print_exc(limit=3)
    del graph
    try:
        torch.cuda.synchronize(case.device)
    except Exception as e:  # a sticky CUDA error: every later call will report it too
        row.setdefault("error", "synchronize after graph: " + error_text(e))
    return row
