"""`python -m graphexec demo`: sample a mixed batch and show that tokens are path-invariant."""

from __future__ import annotations

import argparse
import logging
import time

import torch

import graphexec as gx


def _demo_params() -> list[tuple[str, gx.SamplingParams]]:
    P = gx.SamplingParams
    return [
        ("greedy", P(temperature=0.0, seed=1, logprobs=3)),
        ("top-k 50 / top-p 0.9", P(temperature=0.8, top_k=50, top_p=0.9, seed=2, logprobs=3)),
        ("top-p 0.95", P(temperature=1.0, top_p=0.95, seed=3, logprobs=0)),
        (
            "min-p 0.05",
            P(temperature=1.2, min_p=0.05, seed=4, logprobs=3, logprobs_mode="processed"),
        ),
        (
            "penalties",
            P(
                temperature=0.7,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                repetition_penalty=1.3,
                seed=5,
                logprobs=3,
            ),
        ),
        (
            "logit bias",
            P(
                temperature=0.7,
                logit_bias={9906: 15.0, 1917: 15.0},
                seed=6,
                logprobs=3,
                logprobs_mode="processed",
            ),
        ),
        ("bitmask: digits", P(temperature=1.0, seed=7, logprobs=3)),
        ("plain T=1", P(seed=8)),
    ]


def demo(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = gx.Tokenizer.cl100k()
    V = tok.vocab_size
    rows = _demo_params()
    B = len(rows)
    gen = torch.Generator().manual_seed(args.seed)
    logits = (torch.randn(B, V, generator=gen) * 3.0).to(device)
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts[4, torch.randint(V, (50,), generator=gen)] = 2
    prompt = torch.zeros(B, V, dtype=torch.bool)
    prompt[4, torch.randint(V, (50,), generator=gen)] = True
    # the "digits" row may only sample tokens that decode to ASCII digits
    allowed = torch.zeros(B, V, dtype=torch.bool)
    allowed[[r for r in range(B) if r != 6]] = True
    for i in range(V):
        b = tok.token_bytes(i)
        if b and b.isdigit():
            allowed[6, i] = True
    bits = (
        allowed.reshape(B, -1, 1)
        if V % 32 == 0
        else torch.nn.functional.pad(allowed, (0, 32 - V % 32)).reshape(B, -1, 32)
    )
    bitmask = (bits.to(torch.int64) << torch.arange(32)).sum(-1).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    params = [p for _, p in rows]
    kw = dict(
        token_counts=counts.to(device), prompt_mask=prompt.to(device), bitmask=bitmask.to(device)
    )
    print(f"graphexec {gx.__version__} on {device}; vocabulary {V} ({tok.name})")
    for step in range(args.steps):
        pos = [step] * B
        t0 = time.perf_counter()
        out = gx.sample_logits(logits, params, pos, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) * 1e3
        print(f"\nstep {step} (position {step}), {dt:.1f} ms")
        for b, (name, p) in enumerate(rows):
            t = int(out.token_ids[b])
            line = f"  {name:22s} token {t:6d} {tok.decode([t])!r:14s}"
            if p.logprobs is not None:
                line += f" logprob {float(out.logprobs[b]):8.4f} rank {int(out.ranks[b]):5d}"
                if p.logprobs:
                    top = ", ".join(
                        f"{tok.decode([int(i)])!r}:{float(v):.2f}"
                        for i, v in zip(
                            out.top_token_ids[b, : p.logprobs],
                            out.top_logprobs[b, : p.logprobs],
                            strict=True,
                        )
                    )
                    line += f"  top: {top}"
            print(line)
        # the invariant: the same rows, reversed into another batch order, give the same tokens
        rev = list(reversed(range(B)))
        again = gx.sample_logits(
            logits[rev],
            [params[i] for i in rev],
            pos,
            **{k: v[rev] for k, v in kw.items()},
        )
        same = torch.equal(again.token_ids.flip(0), out.token_ids)
        print(f"  batch order reversed -> same tokens: {same}")
        if not same:
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphexec")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="sample a mixed batch and check batch invariance")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "demo":
        return demo(args)
    return 2
