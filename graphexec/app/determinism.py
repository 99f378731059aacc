"""`python -m graphexec determinism` (= `python tools/determinism_check.py`): replay vs
eager, token for token and logprob for logprob, per graph key; and, with
`--model CONFIG`, a real model's batch invariance.

Builds an executor (TinyLM by default), captures every key, then runs (1) a seeded mixed
workload (grammars, logprobs, penalties, seeded and unseeded requests arriving over time)
and (2) for every captured key, a batch made to run that key for `--key-steps` steps;
each once replayed and once eagerly (unseeded requests get the seeds reported by the
replayed run). Then the same with speculation on (`--speculative`: an n-gram drafter and a
smaller TinyLM as draft model, K = 3, strict): every spec_k key replayed vs eager, and
the mixed workload's tokens equal to those without speculation. Prints compared tokens
and mismatches per key; exit 1 on any mismatch.

`--model` (`graphexec.models.choice`) also takes a Llama / Qwen2 / Mistral checkpoint
folder, smollm2, or a config (a .json, or `qwen2.5-0.5b` / `llama-3.2-1b` from
benchmarks/configs/: seeded random weights) run by HFTransformer in `--dtype` (auto, as
every tool: the config's dtype on CUDA, float32 on the CPU), batch-invariant, with its own
tokenizer (cl100k for a config). Then every request of the seeded mixed workload (greedy,
top-k/top-p, min-p, penalties, logprobs, grammars; prompts up to 300 tokens) must give the
same tokens and logprobs, bit for bit, as in one batch replayed: (a) alone, in four waves,
admitted in reverse order; (b) with n-gram speculation and with a two-layer draft model of
the same shape and vocabulary (strict, K = 3), replayed and eager; (c) with prefill
budgets 64 and 256; (d) eagerly; then the per-key replay-vs-eager runs as above.

Modes. The default (full) mode runs everything above: on the CPU with TinyLM (100k-token
vocabulary) that takes many minutes. `--quick` checks the same properties on less: a
batch of 1 (bucket 1 only), 1 mixed-workload request, one step per key, and speculation
through the draft model only (whose key batches run every spec_k key): about 20 s on a
2-core CPU; with a real model (`--model smollm2|PATH|CONFIG`), batch 2, 2 requests and
the n-gram drafter only. Explicit flags override what `--quick` picks. Progress lines go
to stderr, per run ("[speculative ngram 3/13]": its capture and mixed workload, then each
of its keys, counted once its keys are known) with an estimate of the run's time left;
stdout (the summary tables) is the same in both modes.

    python -m graphexec determinism [--quick] [--model smollm2|PATH|CONFIG|tiny|table]
        [--max-batch-size N] [--requests N] [--key-steps N] [--device cuda|cpu]
        [--speculative all|ngram|draft|none] [--dtype auto|bfloat16|float16|float32]
        [--threads N]
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
from graphexec.app import workload as wl
from graphexec.models.choice import add_model_argument, resolve_model
from graphexec.models.demo_model import DTYPES, ModelChoiceError, choose_model
from graphexec.runtime.threads import add_threads_argument, configure_threads


def both(ex: gx.DecodeExecutor, items: list[wl.WorkItem]) -> tuple[wl.Trace, list[wl.Mismatch]]:
    replayed, eager = wl.replay_and_eager(ex, items)
    return replayed, wl.compare(replayed, eager)


class Progress:
    """Lines on stderr per phase of one run, "[label i/total] what: time so far, about N s
    left in this run" (from the mean time of its phases done). `total` is known when the
    run's progress starts, so the count never jumps; `t0`: when the whole check began."""

    def __init__(self, label: str, total: int, t0: float | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.start = time.perf_counter()
        self.t0 = self.start if t0 is None else t0

    def step(self, what: str) -> None:
        self.done += 1
        now = time.perf_counter()
        left = (now - self.start) / self.done * max(self.total - self.done, 0)
        print(f"[{self.label} {self.done}/{self.total}] {what}: {now - self.t0:.0f} s so far, "
              f"about {left:.0f} s left in this run", file=sys.stderr, flush=True)  # fmt: skip


def table(headers: tuple[str, ...], rows: list[tuple]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, each as
    wide as its widest cell (long key or comparison names never break the columns)."""
    cells = [tuple(map(str, headers)), *(tuple(map(str, r)) for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(" ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in
                                                        zip(r[1:], widths[1:], strict=True))])
                     for r in cells)  # fmt: skip


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The check's options (`python -m graphexec determinism`, tools/determinism_check.py)."""
    ap.add_argument("--quick", action="store_true",
                    help="the same checks on less work (batch 1, 1 request, 1 step a key, "
                    "draft-model speculation only; a real model: batch 2, 2 requests, "
                    "n-gram only): about 20 s on a 2-core CPU with tiny")  # fmt: skip
    add_model_argument(ap)
    ap.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                    help="a real model's (smollm2, PATH, CONFIG) weights' dtype (auto, as "
                    "every tool: the config's dtype on CUDA, float32 on the CPU)")  # fmt: skip
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="default 256 GPU, 8 CPU (--quick: 1; a real model 2)")  # fmt: skip
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="mixed workload size (default 3x the batch; --quick: 1, a real model 2)",
    )
    ap.add_argument("--key-steps", type=int, default=None,
                    help="steps of each key's batch (default 8; --quick: 1)")  # fmt: skip
    ap.add_argument("--speculative", choices=("all", "ngram", "draft", "none"), default=None,
                    help="drafters to check (default all; --quick: draft, or ngram with a "
                    "real model)")  # fmt: skip
    add_threads_argument(ap)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="graphexec determinism",
                                 description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(ap)
    return ap


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`--quick` fills in the smaller settings the module docstring lists, where no
    explicit flag was given; the full mode its own."""
    real = args.model not in ("tiny", "table")
    quick = {"max_batch_size": 2 if real else 1, "requests": 2 if real else 1, "key_steps": 1,
             "speculative": "ngram" if real else "draft"}  # fmt: skip
    full = {"key_steps": 8, "speculative": "all"}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, defaults filled in (`fill_defaults`)."""
    return fill_defaults(parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return check(parse_args(argv))


def check(args: argparse.Namespace) -> int:
    """Run the check `args` ask for (`fill_defaults` applied): 0 when every comparison
    matched, 1 on a mismatch, 2 for a --model that names no model."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configure_threads(device.type, args.threads)
    cuda = device.type == "cuda"
    batch = args.max_batch_size or (256 if cuda else 8)
    try:
        chosen = resolve_model(args.model)
        if chosen.kind not in ("tiny", "table"):
            dm = choose_model(chosen, device, args.dtype, max_seq_len=512)
    except ModelChoiceError as e:
        print(f"graphexec determinism: {e}", file=sys.stderr)
        return 2
    if chosen.kind not in ("tiny", "table"):
        return check_real_model(args, device, batch, dm)
    tok = gx.Tokenizer.cl100k()

    def model(small: bool = False):
        if chosen.kind == "table":
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
    for r, name in enumerate(runs, 1):
        ex = gx.DecodeExecutor(model(), max_batch_size=batch, device=device, tokenizer=tok,
                               seed=0, speculative=specs[name])  # fmt: skip
        ex.capture(progress=sys.stderr.isatty())
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
        progress = Progress(f"run {r}/{len(runs)}: speculative {name},", 1 + len(ex.graph_keys),
                            t0)  # fmt: skip
        progress.step("capture and mixed workload")
        for key in ex.graph_keys:
            work = wl.key_workload(key, ex.buckets, args.key_steps, grammar=grammar)
            trace, mism = both(ex, work)
            compared.update(wl.outputs_per_key(trace))
            bad += mism
            progress.step(f"key {key}")
    per_key = Counter(m.key for m in bad)
    keys = sorted(set(compared) | set(per_key), key=lambda k: (k is not None, str(k)))
    print("\n" + table(("key", "tokens compared", "mismatches"),
                       [(key or "first token (eager)", compared[key], per_key[key])
                        for key in keys]))  # fmt: skip
    unexercised = [k for k in all_keys if compared[k] == 0]
    print(f"\n{sum(compared.values())} tokens compared over {len(compared) - (None in compared)} "
          f"replayed keys ({len(unexercised)} captured keys never ran) in "
          f"{time.perf_counter() - t0:.1f} s on {device}"
          f"{'' if cuda else ' (graphs emulated)'}: {len(bad)} mismatches")  # fmt: skip
    for m in bad[:20]:
        print(f"  {m.request_id} position {m.position}: {m.what} differs (key {m.key})")
    return 1 if bad else 0


def check_real_model(args, device: torch.device, batch: int, dm) -> int:
    """A real model (`DemoModel` dm): the batch-invariance comparisons
    (`workload.batch_invariance`), then replay vs eager for every key."""
    tok = dm.tokenizer
    name = dm.spec.name

    def make(**options) -> gx.DecodeExecutor:
        ex = gx.DecodeExecutor(dm.make(), max_batch_size=batch, device=device, tokenizer=tok,
                               seed=0, **options)  # fmt: skip
        ex.capture(progress=False)
        return ex

    t0 = time.perf_counter()
    n = args.requests or batch
    items = wl.mixed_workload(n, tok.vocab_size, seed=1, grammars=True, max_tokens=(24, 40),
                              prompt_tokens=(1, 300))  # fmt: skip
    items = [dataclasses.replace(it, arrive=0) for it in items]
    specs = {}
    if args.speculative in ("all", "ngram"):
        specs["ngram"] = gx.SpeculativeConfig(3, drafter="ngram")
    if args.speculative in ("all", "draft"):  # read only when it runs
        specs[f"draft model ({dm.draft_name})"] = gx.SpeculativeConfig(3, drafter=dm.draft())
    print(f"batch invariance of {len(items)} requests: alone, in waves, reordered, with "
          f"{len(specs)} drafter(s), prefill budgets 64 and 256, eager ...", file=sys.stderr,
          flush=True)  # fmt: skip
    report = wl.batch_invariance(make, items, specs, budgets=(64, 256))
    streams = len(items)
    kind = "random weights" if dm.random_weights else "checkpoint"
    dtype = str(dm.make().dtype).removeprefix("torch.")
    print(f"{name} ({kind}, {dtype}) on {device}: {streams} requests, each compared with the "
          "same request in one batch, replayed")  # fmt: skip
    print("\n" + table(("comparison", "differing streams", "mismatches"),
                       [(what, len({m.request_id for m in mism}), len(mism))
                        for what, mism in report.items()]))  # fmt: skip
    bad = sum(len(m) for m in report.values())
    ex = make()
    grammar = gx.Grammar.json_schema(wl.ANSWER_SCHEMA)
    compared: Counter = Counter()
    progress = Progress("replay vs eager,", len(ex.graph_keys), t0)
    for key in ex.graph_keys:
        a, b = wl.replay_and_eager(ex, wl.key_workload(key, ex.buckets, args.key_steps,
                                                       grammar=grammar))  # fmt: skip
        compared.update(wl.outputs_per_key(a))
        mism = wl.compare(a, b)
        bad += len(mism)
        if mism:
            print(f"key {key}: {len(mism)} replay/eager mismatches")
        progress.step(f"key {key}")
    print(f"\nreplay vs eager over {len(ex.graph_keys)} keys: {sum(compared.values())} tokens "
          f"compared; {bad} mismatches in all, {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 1 if bad else 0
