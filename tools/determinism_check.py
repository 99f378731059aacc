"""Replay vs eager, token for token and logprob for logprob, per graph key; and, with
`--model CONFIG`, a real model's batch invariance.

Builds an executor (TinyLM by default), captures every key, then runs (1) a seeded mixed
workload (grammars, logprobs, penalties, seeded and unseeded requests arriving over time)
and (2) for every captured key, a batch made to run that key for `--key-steps` steps;
each once replayed and once eagerly (unseeded requests get the seeds reported by the
replayed run). Then the same with speculation on (`--speculative`: an n-gram drafter and a
smaller TinyLM as draft model, K = 3, strict): every spec_k key replayed vs eager, and
the mixed workload's tokens equal to those without speculation. Prints compared tokens
and mismatches per key; exit 1 on any mismatch.

`--model` also takes a Llama / Qwen2 / Mistral checkpoint folder or config (a .json, or
`qwen2.5-0.5b` / `llama-3.2-1b` from benchmarks/configs/: seeded random weights) run by
HFTransformer in `--dtype` (bfloat16 by default), batch-invariant. Then every request of
the seeded mixed workload (greedy, top-k/top-p, min-p, penalties, logprobs, grammars;
prompts up to 300 tokens) must give the same tokens and logprobs, bit for bit, as in one
batch replayed: (a) alone, in four waves, admitted in reverse order; (b) with n-gram
speculation and with a two-layer draft model of the same shape and vocabulary (strict,
K = 3), replayed and eager; (c) with prefill budgets 64 and 256; (d) eagerly; then the
per-key replay-vs-eager runs as above.

Modes. The default (full) mode runs everything above: on the CPU with TinyLM (100k-token
vocabulary) that takes many minutes. `--quick` checks the same properties on less: a
batch of 2 (so buckets 1 and 2 only), 2 mixed-workload requests, one step per key, and
speculation through the draft model only (whose key batches run every spec_k key); with
`--model PATH|CONFIG`, 2 requests and the n-gram drafter only. Explicit flags override
what `--quick` picks. Progress lines with an estimate of the time left go to stderr;
stdout (the summary table) is the same in both modes.

    python tools/determinism_check.py [--quick] [--model tiny|table|PATH|CONFIG]
        [--max-batch-size N] [--requests N] [--key-steps N] [--device cuda|cpu]
        [--speculative all|ngram|draft|none] [--dtype bfloat16|float16|float32] [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections import Counter

import torch

import graphexec as gx
from graphexec import workload as wl
from graphexec.cli import add_threads_argument, benchmarks_dir, configure_threads

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def both(ex: gx.DecodeExecutor, items: list[wl.WorkItem]) -> tuple[wl.Trace, list[wl.Mismatch]]:
    replayed, eager = wl.replay_and_eager(ex, items)
    return replayed, wl.compare(replayed, eager)


class Progress:
    """Per-phase lines on stderr: what ran, time so far, and an estimate of the time left
    from the mean time of the phases done (phases still to come may only be guessed)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def grow(self, n: int) -> None:
        self.total += n

    def step(self, what: str) -> None:
        self.done += 1
        spent = time.perf_counter() - self.t0
        left = spent / self.done * max(self.total - self.done, 0)
        print(f"[{self.done}/{self.total}] {what}: {spent:.0f} s so far, about {left:.0f} s "
              "left", file=sys.stderr, flush=True)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `--quick` fills in the smaller settings the module docstring
    lists, where no explicit flag was given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="the same checks on less work (batch 2, 2 requests, 1 step a key, "
                    "draft-model speculation only): under a minute on a 2-core CPU")  # fmt: skip
    ap.add_argument("--model", default="tiny", metavar="tiny|table|PATH|CONFIG")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="--model PATH|CONFIG: the weights' dtype")  # fmt: skip
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-batch-size", type=int, default=None, help="default 256 GPU, 8 CPU")
    ap.add_argument("--requests", type=int, default=None, help="mixed workload size")
    ap.add_argument("--key-steps", type=int, default=None, help="default 8 (--quick: 1)")
    ap.add_argument("--speculative", choices=("all", "ngram", "draft", "none"), default=None,
                    help="default all (--quick: draft; ngram with --model PATH|CONFIG)")
    add_threads_argument(ap)
    args = ap.parse_args(argv)
    real = args.model not in ("tiny", "table")
    quick = {"max_batch_size": 2, "requests": 2, "key_steps": 1,
             "speculative": "ngram" if real else "draft"}  # fmt: skip
    full = {"key_steps": 8, "speculative": "all"}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configure_threads(device.type, args.threads)
    cuda = device.type == "cuda"
    batch = args.max_batch_size or (256 if cuda else 8)
    tok = gx.Tokenizer.cl100k()
    if args.model not in ("tiny", "table"):
        return check_real_model(args, device, batch, tok)

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
    progress = Progress(len(runs))  # grows by each run's keys once they are captured
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
              + spec, flush=True)  # fmt: skip
        progress.grow(len(ex.graph_keys))
        progress.step(f"speculative {name}: capture and mixed workload")
        for key in ex.graph_keys:
            work = wl.key_workload(key, ex.buckets, args.key_steps, grammar=grammar)
            trace, mism = both(ex, work)
            compared.update(wl.outputs_per_key(trace))
            bad += mism
            progress.step(f"speculative {name}: key {key}")
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


def check_real_model(args, device: torch.device, batch: int, tok: gx.Tokenizer) -> int:
    """--model PATH|CONFIG: the batch-invariance comparisons (`workload.batch_invariance`),
    then replay vs eager for every key."""
    sys.path.insert(0, str(benchmarks_dir()))
    from step_model import resolve  # the configs and checkpoints bench_step takes

    from graphexec.models.hf_random import random_model

    name, cfg, folder = resolve(args.model)
    dtype = DTYPES[args.dtype]

    def model(layers: int | None = None, seed: int = 0):
        if folder is not None and layers is None:
            return gx.models.HFTransformer.from_pretrained(folder, device, dtype, max_seq_len=512)
        c = cfg if layers is None else dict(cfg, num_hidden_layers=layers)
        return random_model(c, seed=seed, device=device, dtype=dtype, max_seq_len=512)

    def make(**options) -> gx.DecodeExecutor:
        ex = gx.DecodeExecutor(model(), max_batch_size=batch, device=device, tokenizer=tok,
                               seed=0, **options)  # fmt: skip
        ex.capture(progress=False)
        return ex

    t0 = time.perf_counter()
    n = args.requests or batch
    items = wl.mixed_workload(n, tok.vocab_size, seed=1, grammars=True, max_tokens=(24, 40),
                              prompt_tokens=(1, 300))  # fmt: skip
    items = [dataclasses.replace(it, arrive=0) for it in items]
    specs = {"ngram": gx.SpeculativeConfig(3, drafter="ngram"),
             "draft model": gx.SpeculativeConfig(3, drafter=model(layers=2, seed=1))}  # fmt: skip
    specs = {k: v for k, v in specs.items() if args.speculative in ("all", k.split()[0])}
    print(f"batch invariance of {len(items)} requests: alone, in waves, reordered, with "
          f"{len(specs)} drafter(s), prefill budgets 64 and 256, eager ...", file=sys.stderr,
          flush=True)  # fmt: skip
    report = wl.batch_invariance(make, items, specs, budgets=(64, 256))
    streams = len(items)
    print(f"{name} ({'checkpoint' if folder else 'random weights'}, {args.dtype}) on {device}: "
          f"{streams} requests, each compared with the same request in one batch, replayed")
    print(f"\n{'comparison':32s} {'differing streams':>17s} {'mismatches':>10s}")
    bad = 0
    for what, mism in report.items():
        print(f"{what:32s} {len({m.request_id for m in mism}):17d} {len(mism):10d}")
        bad += len(mism)
    ex = make()
    grammar = gx.Grammar.json_schema(wl.ANSWER_SCHEMA)
    compared: Counter = Counter()
    progress = Progress(len(ex.graph_keys))
    for key in ex.graph_keys:
        a, b = wl.replay_and_eager(ex, wl.key_workload(key, ex.buckets, args.key_steps,
                                                       grammar=grammar))  # fmt: skip
        compared.update(wl.outputs_per_key(a))
        mism = wl.compare(a, b)
        bad += len(mism)
        if mism:
            print(f"key {key}: {len(mism)} replay/eager mismatches")
        progress.step(f"replay vs eager, key {key}")
    print(f"\nreplay vs eager over {len(ex.graph_keys)} keys: {sum(compared.values())} tokens "
          f"compared; {bad} mismatches in all, {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
