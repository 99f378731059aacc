"""The methods `bench_verify.py` times (graphexec, FlashInfer, torch-native), the per-row
parameter tables they share, the torch rejection sampler, and how one method is timed.

A VerifyCase holds static [B, K+1, V] fp32 target logits, [B, K] drafts and one parameter
table (TABLES: "top_k_top_p", mixed rows, or "no_filter", temperature only);
BUILDERS[name](case) prepares one method over static buffers and returns a Bench whose
fn() is one verification (or, for graphexec.sample_step, one ordinary draw of the same
B*(K+1) rows) and returns its [B, K+1] token ids. graphexec and FlashInfer are imported on
first use, so this module imports with torch alone. run_method(name, case, timer,
first_call) times one method and returns its results row (see bench_verify.py).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sampler_methods import Timer, error_text, pick_methods

TEMPERATURES = (0.7, 0.8, 0.9, 1.0)
TOP_K, TOP_P = 50, 0.9

TABLES = {
    "top_k_top_p": "mixed rows: temperature 0.7 / 0.8 / 0.9 / 1.0 cycling; row b % 3 == 0: "
    "top-k 50 + top-p 0.9, == 1: top-k 200 + top-p 0.9, == 2: top-k 50 (graphexec variant "
    "top_k_top_p)",
    "no_filter": "temperature 0.7 / 0.8 / 0.9 / 1.0 cycling, no filter (variant no_filter)",
}

METHODS = {
    "graphexec.verify_strict": "verify_step(method='strict') over static buffers and a "
    "persistent workspace of B*(K+1) rows, as the executor captures it",
    "graphexec.sample_step": "sample_step over the same B*(K+1) rows (slot b, position "
    "pos + j, no draft counts): the ordinary draw strict verification is built on",
    "flashinfer.chain": "flashinfer.sampling.softmax(temperature) [+ top_k_renorm_probs + "
    "top_p_renorm_probs] + chain_speculative_sampling; one-hot draft_probs given (not timed)",
    "flashinfer.chain+onehot": "flashinfer.chain with the one-hot [B, K, V] draft_probs "
    "built inside the call (zero + scatter), as an engine with n-gram drafts must",
    "torch.rejection": "vLLM-style torch rejection sampler (rejection_sample below): softmax, "
    "sort-based top-k/top-p, accept u < p/q, recovered/bonus by exponential race",
    "graphexec.verify_rejection": "verify_step(method='rejection') (torch reference of the "
    "probability step, float64; opt-in: --methods graphexec.verify_rejection)",
}
DEFAULT_METHODS = [m for m in METHODS if m != "graphexec.verify_rejection"]


def row_params(table: str, B: int) -> list[dict]:
    """B dicts of SamplingParams fields (seed excluded) for one of TABLES."""
    if table not in TABLES:
        raise ValueError(f"table must be one of {list(TABLES)}, got {table!r}")
    rows = []
    for b in range(B):
        p = dict(temperature=TEMPERATURES[b % len(TEMPERATURES)])
        if table == "top_k_top_p":
            p.update([dict(top_k=TOP_K, top_p=TOP_P), dict(top_k=4 * TOP_K, top_p=TOP_P),
                      dict(top_k=TOP_K)][b % 3])  # fmt: skip
        rows.append(p)
    return rows


def flat_tensors(params: list[dict], T: int, V: int, device) -> dict:
    """Per-row parameters repeated over the T offsets ([B*T] each, row-major as the
    flattened logits): temperature (f32), top_k (i32, V = off), top_p (f32, 1 = off)."""

    def rep(values, dtype):
        return torch.tensor(values, dtype=dtype).repeat_interleave(T).to(device)

    ks = [p["top_k"] if p.get("top_k", 0) > 0 else V for p in params]
    return dict(
        temperature=rep([p["temperature"] for p in params], torch.float32),
        top_k=rep(ks, torch.int32),
        top_p=rep([p.get("top_p", 1.0) for p in params], torch.float32),
    )


# ----------------------------------------------------------------------------- torch sampler


def apply_top_k_top_p(x: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None):
    """vLLM's sort-based filter on [R, V] logits (k: [R] ints, V = off; p: [R], 1 = off):
    top-k, then top-p on the kept mass; masked logits become -inf. No host sync."""
    sv, si = x.sort(dim=-1, descending=False)
    if k is not None:
        kth = sv.gather(1, (x.shape[1] - k.long()).clamp(min=0).unsqueeze(1))
        sv = sv.masked_fill(sv < kth, -torch.inf)
    if p is not None:
        cum = sv.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p.unsqueeze(1)
        drop[:, -1] = False  # the most likely token is always kept
        sv = sv.masked_fill(drop, -torch.inf)
    return torch.empty_like(sv).scatter_(1, si, sv)


def rejection_sample(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling (Leviathan et al.) as vLLM's torch path does it; capturable.

    logits [B, T, V] (T = K + 1), drafts [B, K] int64 (-1 pads a suffix), temperature /
    top_k / top_p [B*T] per flattened row (temperature 0 = greedy, honoured only with
    greedy=True: then p is one-hot at the first argmax), draft_probs [B, K, V] or None
    (one-hot q at the draft). Accept d_j iff u_j * q_j(d_j) < p_j(d_j); at the first
    rejection emit argmax(max(0, p_j - q_j) / Exp(1)), after K acceptances the bonus
    argmax(p_K / Exp(1)). Returns (token_ids [B, T] int64, -1 after the run; num_accepted
    [B] int64). Randomness from torch's generator (graph-safe), not per request.
    """
    B, T, V = logits.shape
    K = T - 1
    t = temperature.float().unsqueeze(1)
    x = logits.reshape(B * T, V).float() / torch.where(t > 0, t, 1.0)
    if top_k is not None or top_p is not None:
        x = apply_top_k_top_p(x, top_k, top_p)
    probs = x.softmax(dim=-1)
    if greedy:
        top = logits.reshape(B * T, V).argmax(dim=-1, keepdim=True)
        onehot = torch.zeros_like(probs).scatter_(1, top, 1.0)
        probs = torch.where(t == 0, onehot, probs)
    probs = probs.view(B, T, V)
    pk = probs[:, :K]
    has = drafts >= 0
    d = drafts.clamp(min=0).unsqueeze(2)
    px = pk.gather(2, d).squeeze(2)
    if draft_probs is None:  # one-hot q: max(0, p - q) is p with the draft's entry zeroed
        qx = torch.ones_like(px)  # (a pad's entry stays: its offset draws from p)
        resid = pk.scatter(2, d, torch.where(has, 0.0, px).unsqueeze(2))
    else:
        q = draft_probs.float()
        qx = q.gather(2, d).squeeze(2)
        resid = torch.where(has.unsqueeze(2), (pk - q).clamp_(min=0), pk)
    u = torch.rand(B, K, device=logits.device)
    accepted = has & (u * qx < px)
    n_acc = torch.cumprod(accepted.long(), dim=1).sum(dim=1)
    race = torch.empty_like(probs).exponential_()
    rec = resid.div_(race[:, :K]).argmax(dim=-1)
    bonus = probs[:, K].div(race[:, K]).argmax(dim=-1, keepdim=True)
    cand = torch.cat([rec, bonus], dim=1)
    j = torch.arange(T, device=logits.device).unsqueeze(0)
    n = n_acc.unsqueeze(1)
    padded = torch.cat([drafts, drafts.new_full((B, 1), -1)], dim=1)
    last = cand.gather(1, n)
    tokens = torch.where(j < n, padded, torch.where(j == n, last, -1))
    return tokens, n_acc


# ----------------------------------------------------------------------------- methods


@dataclass
class VerifyCase:
    logits: torch.Tensor  # [B, K+1, V] fp32, static
    drafts: torch.Tensor  # [B, K] int64, static
    table: str  # a key of TABLES
    device: torch.device
    gx_backend: str

    @property
    def shape(self) -> tuple[int, int, int]:
        B, T, V = self.logits.shape
        return B, T - 1, V


@dataclass
class Bench:
    fn: Callable[[], torch.Tensor]  # one call; returns [B, K+1] token ids (-1 padded)
    note: str | None = None


def _gx(kind: str):
    def build(c: VerifyCase) -> Bench:
        import graphexec as gx
        from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
        from graphexec.speculative import VerifyOutput, verify_step

        B, K, V = c.shape
        T = K + 1
        params = [gx.SamplingParams(seed=1000 + b, **p)
                  for b, p in enumerate(row_params(c.table, B))]  # fmt: skip
        variant = gx.choose_variant(params)
        if variant.value != c.table:
            raise RuntimeError(f"table {c.table!r} chose variant {variant.value!r}")
        table = SamplingTensors.from_params(params, V, c.device)
        ws = cfg = None
        if c.gx_backend == "triton":  # persistent scratch for B*(K+1) rows, as the executor's
            from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

            cfg = SamplerConfig.default()
            ws = Workspace.allocate(B * T, V, c.device, cfg, False)
        slot_ids = torch.arange(B, device=c.device)
        positions = torch.arange(B, device=c.device) + 7
        if kind == "sample_step":
            out = SamplerOutput.allocate(B * T, c.device, None)
            flat = c.logits.view(B * T, V)
            rows_slot = slot_ids.repeat_interleave(T)
            rows_pos = (positions.unsqueeze(1) + torch.arange(T, device=c.device)).reshape(-1)

            def fn() -> torch.Tensor:
                gx.sample_step(flat, rows_slot, rows_pos, table, out, None, variant,
                               c.gx_backend, config=cfg, workspace=ws)  # fmt: skip
                return out.token_ids.view(B, T)

            return Bench(fn)
        vout = VerifyOutput.allocate(B, K, c.device, None)

        def fn() -> torch.Tensor:
            verify_step(c.logits, c.drafts, slot_ids, positions, table, vout, None, None,
                        kind, variant, c.gx_backend, config=cfg, workspace=ws)  # fmt: skip
            return vout.token_ids

        return Bench(fn)

    return build


def _fi_chain(onehot_in_call: bool):
    def build(c: VerifyCase) -> Bench:
        import flashinfer.sampling as fs

        B, K, V = c.shape
        T = K + 1
        pt = flat_tensors(row_params(c.table, B), T, V, c.device)
        filtered = c.table != "no_filter"
        flat = c.logits.view(B * T, V)
        draft_i32 = c.drafts.to(torch.int32)
        idx = c.drafts.clamp(min=0).unsqueeze(2)
        draft_probs = torch.zeros(B, K, V, dtype=torch.float32, device=c.device)
        draft_probs.scatter_(2, idx, 1.0)
        seed = torch.arange(1000, 1000 + B, dtype=torch.int64, device=c.device)
        offset = torch.full((B,), 7 << 16, dtype=torch.int64, device=c.device)

        def fn() -> torch.Tensor:
            probs = fs.softmax(flat, temperature=pt["temperature"])
            if filtered:  # top-k first, then top-p on the kept mass (graphexec's order)
                probs = fs.top_k_renorm_probs(probs, pt["top_k"])
                probs = fs.top_p_renorm_probs(probs, pt["top_p"])
            if onehot_in_call:
                draft_probs.zero_().scatter_(2, idx, 1.0)
            ids, _, _ = fs.chain_speculative_sampling(draft_probs, draft_i32,
                                                      probs.view(B, T, V), seed=seed,
                                                      offset=offset)  # fmt: skip
            return ids

        return Bench(fn)

    return build


def _torch_rejection(c: VerifyCase) -> Bench:
    B, K, V = c.shape
    pt = flat_tensors(row_params(c.table, B), K + 1, V, c.device)
    filtered = c.table != "no_filter"
    k, p = (pt["top_k"], pt["top_p"]) if filtered else (None, None)
    return Bench(lambda: rejection_sample(c.logits, c.drafts, pt["temperature"], k, p)[0])


BUILDERS: dict[str, Callable[[VerifyCase], Bench]] = {
    "graphexec.verify_strict": _gx("strict"),
    "graphexec.sample_step": _gx("sample_step"),
    "flashinfer.chain": _fi_chain(False),
    "flashinfer.chain+onehot": _fi_chain(True),
    "torch.rejection": _torch_rejection,
    "graphexec.verify_rejection": _gx("rejection"),
}
assert list(BUILDERS) == list(METHODS)


def select_methods(spec: str | None) -> list[str]:
    """Comma list; a token naming a method exactly selects it, else every default method
    containing it. None: DEFAULT_METHODS."""
    return pick_methods(spec, METHODS, DEFAULT_METHODS)


# ----------------------------------------------------------------------------- timing


def check_run(tokens: torch.Tensor, V: int, verify: bool) -> tuple[float | None, str | None]:
    """(mean tokens emitted per row or None for sample_step, a problem or None): every
    entry in [-1, V), and for a verification the emitted ids are a non-empty prefix."""
    tok = tokens.long().cpu()
    if int(tok.min()) < -1 or int(tok.max()) >= V:
        return None, f"ids outside [-1, {V}): min {int(tok.min())}, max {int(tok.max())}"
    if not verify:
        return None, None if int(tok.min()) >= 0 else "sample_step returned -1"
    ok = tok >= 0
    n = ok.sum(dim=1)
    prefix = ok == (torch.arange(tok.shape[1]).unsqueeze(0) < n.unsqueeze(1))
    if not bool(prefix.all()) or int(n.min()) < 1:
        return None, "emitted ids are not a non-empty prefix of each row"
    return round(float(n.float().mean()), 3), None


def blank_row(method: str, table: str, B: int, K: int, V: int, shape: str) -> dict:
    return dict(method=method, variant=table, B=B, K=K, V=V, shape=shape, us=None,
                floor_us=None, emitted=None)  # fmt: skip


def run_method(name: str, case: VerifyCase, timer: Timer, first_call: dict,
               shape: str) -> dict:  # fmt: skip
    """One JSON row; never raises (except KeyboardInterrupt). us: the median GPU time of
    one CUDA-graph replay (CUDA) or of one eager call (CPU, perf_counter)."""
    B, K, V = case.shape
    row = blank_row(name, case.table, B, K, V, shape)
    verify = name != "graphexec.sample_step"
    if name.startswith("flashinfer.") and not timer.cuda:
        row["error"] = "FlashInfer needs CUDA"
        return row
    try:
        t0 = time.perf_counter()
        bench = BUILDERS[name](case)
        if bench.note:
            row["note"] = bench.note
        tok = bench.fn()
        if timer.cuda:
            torch.cuda.synchronize(case.device)
        first_call.setdefault(name, round(time.perf_counter() - t0, 3))
        if not timer.cuda:  # CPU: eager timings only
            row["emitted"], bad = check_run(tok, V, verify)
            if bad:
                row["warning"] = f"eager: {bad}"
            bench.fn()
            row["us"] = round(timer.time(bench.fn, sync_each=True), 2)
            return row
    except Exception as e:
        row["error"] = error_text(e)
        traceback.print_exc(limit=3)
        return row
    graph = None
    try:
        graph, result = timer.capture(bench.fn)
        row["emitted"], bad = check_run(result, V, verify)
        if bad:
            row["warning"] = f"graph: {bad}"
        row["us"] = round(timer.time(graph.replay, sync_each=False), 2)
    except Exception as e:
        row["error"] = "graph capture/replay: " + error_text(e)
        traceback.print_exc(limit=3)
    del graph
    try:
        torch.cuda.synchronize(case.device)
    except Exception as e:  # a sticky CUDA error: every later call will report it too
        row.setdefault("error", "synchronize after graph: " + error_text(e))
    return row
