"""Replay vs eager, token for token and logprob for logprob, per graph key.

Builds an executor (TinyLM by default), captures every key, then runs (1) a seeded mixed
workload (grammars, logprobs, penalties, seeded and unseeded requests arriving over time)
and (2) for every captured key, a batch made to run that key for `--key-steps` steps;
each once replayed and once eagerly (unseeded requests get the seeds reported by the
replayed run). Then the same with speculation on (`--speculative`: an n-gram drafter and a
smaller TinyLM as draft model, K = 3, strict): every spec_k key replayed vs eager, and
the mixed workload's tokens equal to those without speculation. Prints compared tokens
and mismatches per key; exit 1 on any mismatch.

    python tools/determinism_check.py [--model tiny|table] [--max-batch-size N]
        [--requests N] [--key-steps N] [--device cuda|cpu] [--speculative all|ngram|draft|none]
        [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter

import torch

import graphexec as gx
from graphexec import workload as wl
from graphexec.cli import add_threads_argument, configure_threads


def both(ex: gx.DecodeExecutor, items: list[wl.WorkItem]) -> tuple[wl.Trace, list[wl.Mismatch]]:
    replayed, eager = wl.replay_and_eager(ex, items)
    return replayed, wl.compare(replayed, eager)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "table"), default="tiny")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-batch-size", type=int, default=None, help="default 256 GPU, 8 CPU")
    ap.add_argument("--requests", type=int, default=None, help="mixed workload size")
    ap.add_argument("--key-steps", type=int, default=8)
    ap.add_argument("--speculative", choices=("all", "ngram", "draft", "none"), default="all")
    add_threads_argument(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configure_threads(device.type, args.threads)
    cuda = device.type == "cuda"
    batch = args.max_batch_size or (256 if cuda else 8)
    tok = gx.Tokenizer.cl100k()

    def model(small: bool = False):
        if args.model == "table":
            return gx.models.TableModel(tok.vocab_size, seed=int(small))
        if small:
            return gx.models.TinyLM(tok.vocab_size, seed=1, dim=64, layers=1, max_seq_len=512)
        return gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=512)

    specs = {"none": None, "ngram": gx.SpeculativeConfig(3, drafter="ngram"),
             "draft": gx.SpeculativeConfig(3, drafter=model(small=True))}  # fmt: skip
    runs = ["none"] + ([args.speculative] if args.speculative in specs else ["ngram", "draft"])
    runs = list(dict.fromkeys(runs))
    t0 = time.perf_counter()
    compared: Counter = Counter()
    bad: list[wl.Mismatch] = []
    n = args.requests or 3 * batch
    items = wl.mixed_workload(n, tok.vocab_size, seed=1, grammars=True, spread=n // 4)
    grammar = gx.Grammar.json_schema(wl.ANSWER_SCHEMA)
    plain = None
    all_keys = []
    for name in runs:
        ex = gx.DecodeExecutor(model(), max_batch_size=batch, device=device, tokenizer=tok,
                               seed=0, speculative=specs[name])  # fmt: skip
        ex.capture()
        all_keys += ex.graph_keys
        trace, mism = both(ex, items)
        compared.update(wl.outputs_per_key(trace))
        bad += mism
        same = []
        if plain is None:
            plain = trace
        else:  # strict speculation: the tokens of the run without it (logprobs may differ
            # in the last bits: rows are split differently)
            same = [m for m in wl.compare(plain, trace) if m.what in ("token", "length")]
            bad += same
        stats = ex.stats
        spec = f", acceptance {stats.accepted}/{stats.drafted}" if stats.drafted else ""
        print(f"[speculative {name}] mixed workload: {n} requests, {trace.steps} steps, "
              f"{trace.tokens} tokens, {len(mism)} replay/eager mismatches"
              + (f", {len(same)} differences from no speculation" if name != "none" else "")
              + spec)  # fmt: skip
        for key in ex.graph_keys:
            work = wl.key_workload(key, ex.buckets, args.key_steps, grammar=grammar)
            trace, mism = both(ex, work)
            compared.update(wl.outputs_per_key(trace))
            bad += mism
    per_key = Counter(m.key for m in bad)
    print(f"\n{'key':28s} {'tokens compared':>15s} {'mismatches':>10s}")
    for key in sorted(set(compared) | set(per_key), key=lambda k: (k is not None, str(k))):
        print(f"{str(key or 'first token (eager)'):28s} {compared[key]:15d} {per_key[key]:10d}")
    unexercised = [k for k in all_keys if compared[k] == 0]
    print(f"\n{sum(compared.values())} tokens compared over {len(compared) - (None in compared)} "
          f"replayed keys ({len(unexercised)} captured keys never ran) in "
          f"{time.perf_counter() - t0:.1f} s on {device}"
          f"{'' if cuda else ' (graphs emulated)'}: {len(bad)} mismatches")  # fmt: skip
    for m in bad[:20]:
        print(f"  {m.request_id} position {m.position}: {m.what} differs (key {m.key})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
