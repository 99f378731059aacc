"""transformers' own decoding beside ours in `bench_step.py --model` (step_model.py): the
same weights and prompts, `generate` with its static cache, timed at two lengths so that
prefill and per-call work cancel (step_model's docstring says how; `run_transformers`
adds each B's row to the result)."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

MODES = ("default", "eager")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_transformers(cfg: dict, state: dict | None, folder: Path | None, device: str,
                       dtype: torch.dtype):  # fmt: skip
    """transformers' model of the same weights, on `device`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if folder is not None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise RuntimeError(f"transformers' model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def generate_kwargs(max_seq_len: int, mode: str) -> dict:
    from transformers import GenerationConfig

    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    if hasattr(GenerationConfig(), "max_cache_len"):  # one cache size for every call
        kw["max_cache_len"] = max_seq_len
    if mode == "eager":
        kw["disable_compile"] = True
    return kw


def time_generate(model, ids: torch.Tensor, n: int, kw: dict, device: str) -> float:
    mask = torch.ones_like(ids)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():  # as generate runs by default
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)
    _sync(device)
    dt = time.perf_counter() - t0
    if tuple(out.shape) != (ids.shape[0], ids.shape[1] + n):
        raise RuntimeError(f"generate returned {tuple(out.shape)} for {n} new tokens")
    return dt


def compile_info(model) -> dict:
    """Whether generate compiled the forward, and with which CompileConfig."""
    cc = getattr(model, "_last_compile_config", None)
    if cc is None and hasattr(model, "_compiled_call"):
        cc = getattr(model.generation_config, "compile_config", None)
    out = dict(compiled=hasattr(model, "_compiled_call"))
    if out["compiled"]:
        cfg = cc.to_dict() if hasattr(cc, "to_dict") else {}
        out["compile_config"] = {k: v if isinstance(v, (str, int, float, bool, type(None)))
                                 else repr(v) for k, v in cfg.items()}  # fmt: skip
    return out


def dynamo_counts() -> dict[str, int]:
    """torch.compile's running totals: graphs compiled, CUDA-graph skips."""
    from torch._dynamo.utils import counters

    return dict(graphs=counters["stats"]["unique_graphs"],
                cudagraph_skips=counters["inductor"]["cudagraph_skips"])  # fmt: skip


def transformers_row(model, ids: torch.Tensor, mode: str, args) -> dict:
    n1, n2 = args.hf_tokens
    kw = generate_kwargs(args.max_seq_len, mode)
    c0, t0 = dynamo_counts(), time.perf_counter()
    # the first calls may compile (and record CUDA graphs); eager needs one warm call
    for n in (n2, n1, n2) if mode == "default" else (n1,):
        time_generate(model, ids, n, kw, args.device)
    warmup_s, c1 = time.perf_counter() - t0, dynamo_counts()
    t1, t2 = [], []
    for _ in range(args.hf_reps):
        t1.append(time_generate(model, ids, n1, kw, args.device))
        t2.append(time_generate(model, ids, n2, kw, args.device))
    c2 = dynamo_counts()
    d = statistics.median(t2) - statistics.median(t1)
    B = ids.shape[0]
    r = dict(mode=mode, n1=n1, n2=n2, reps=args.hf_reps, warmup_s=warmup_s,
             t1_s=statistics.median(t1), t2_s=statistics.median(t2),
             token_us=d / (n2 - n1) * 1e6 if d > 0 else None,
             tokens_per_s=B * (n2 - n1) / d if d > 0 else None,
             max_cache_len=kw.get("max_cache_len"), **compile_info(model),
             warmup_counts={k: c1[k] - c0[k] for k in c0},
             timed_counts={k: c2[k] - c1[k] for k in c0})  # fmt: skip
    if r["timed_counts"]["graphs"]:
        r["warning"] = "torch.compile compiled graphs during the timed calls"
    if d <= 0:
        r["error"] = "t(N2) <= t(N1): timing noise larger than the decode steps"
    return r


def run_transformers(result: dict, cfg, state, folder, dtype, prompts, args, save) -> None:
    """Add transformers' rows to result["rows"] (by B), `save()` after each."""
    try:
        import transformers
    except ImportError as e:
        result["transformers"] = dict(error=f"transformers is not importable: {e}")
        print(result["transformers"]["error"])
        return
    transformers.logging.set_verbosity_error()
    info = result["transformers"] = dict(version=transformers.__version__, modes=args.hf_modes)
    t0 = time.perf_counter()
    try:
        model = build_transformers(cfg, state, folder, args.device, dtype)
    except Exception as e:  # report, keep our rows
        info["error"] = f"building transformers' model failed: {type(e).__name__}: {e}"
        print(info["error"])
        return
    info["build_s"] = time.perf_counter() - t0
    budget = args.time_budget
    for mode in args.hf_modes:
        for r in result["rows"]:
            if args.hf_batches and r["batch"] not in args.hf_batches:
                continue
            if budget is not None and time.perf_counter() - args.t_start > budget:
                r.setdefault("transformers", {})[mode] = dict(mode=mode, skipped="time budget")
                continue
            ids = prompts[: r["batch"]].to(args.device)
            try:
                row = transformers_row(model, ids, mode, args)
            except Exception as e:  # a compile or generate failure is a row's result
                row = dict(mode=mode, error=f"{type(e).__name__}: {str(e)[:400]}")
            r.setdefault("transformers", {})[mode] = row
            tps = row.get("tokens_per_s")
            if tps and "tokens_per_s" in r:
                r.setdefault("vs_transformers", {})[mode] = r["tokens_per_s"] / tps
            said = (f"{tps:9.0f} tok/s (compiled: {row['compiled']}, warm-up "
                    f"{row['warmup_s']:.1f} s)" if tps else row.get("error", ""))  # fmt: skip
            print(f"transformers {mode:7s} B={r['batch']:4d} {said}", flush=True)
            save()
    del model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
