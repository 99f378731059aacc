"""bench_step.py --scenario cpu --model smollm2|PATH: graphexec's CPU route against
transformers on one Hugging Face checkpoint, float32, one torch thread count for both.

Three measures, each side by side (the two sides alternate, repetition by repetition,
so a busy machine slows both alike; medians are reported):

    decode     single-stream greedy decode tokens/s after a short prompt: graphexec's
               `HFTransformer.decode` per token, transformers' forward with its KV cache
               per token (a generate-style loop, argmax on the last logits)
    prefill    a `--prefill-len` token prompt into the cache: `HFTransformer.prefill`,
               transformers' forward over the prompt with use_cache
    first      16 prompts of 20 tokens added at once to a `DecodeExecutor` on the CPU
               (greedy): seconds until every request has its first token; transformers:
               one padded forward over the 16 x 20 batch (its first tokens)

Targets (issue "CPU route as fast as transformers"): decode >= 1.0x, prefill >= 0.5x,
first tokens of the 16 within 2 s.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import platform
import statistics
import subprocess
import time

import torch

import graphexec as gx
from graphexec.models.choice import resolve_model


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, cwd=here)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


class Ours:
    def __init__(self, folder, max_seq_len: int) -> None:
        self.model = gx.models.HFTransformer.from_pretrained(
            folder, device="cpu", dtype=torch.float32, max_seq_len=max_seq_len)  # fmt: skip
        self.model.bind(2, "cpu")

    def decode(self, ids: list[int], n: int) -> float:
        m = self.model
        logits = m.prefill(0, torch.tensor(ids[:-1]))
        tok, pos = torch.tensor(ids[-1:]), len(ids) - 1
        t0 = time.perf_counter()
        for i in range(n):
            logits = m.decode(tok, torch.tensor([pos + i]), torch.tensor([0]))
            tok = logits.argmax(-1)
        return n / (time.perf_counter() - t0)

    def prefill(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.model.prefill(1, torch.tensor(ids))
        return time.perf_counter() - t0

    def first_tokens(self, prompts: list[list[int]]) -> float:
        ex = gx.DecodeExecutor(self.model, max_batch_size=len(prompts), device="cpu", seed=0)
        greedy = gx.SamplingParams(temperature=0.0, max_tokens=2)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            ex.add_request(f"r{i}", p, greedy)
        seen: set[str] = set()
        while len(seen) < len(prompts):
            seen |= {o.request_id for o in ex.step() if o.token_id is not None}
        took = time.perf_counter() - t0
        for i in range(len(prompts)):
            ex.abort(f"r{i}")
        ex.step()
        return took


class Theirs:
    def __init__(self, folder) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        # transformers 5 renames past_key_values to cache (the old name warns FutureWarning)
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def decode(self, ids: list[int], n: int) -> float:
        out = self.model(torch.tensor([ids[:-1]]), use_cache=True)
        cache, tok = out[self.cache_arg], torch.tensor([ids[-1:]])
        t0 = time.perf_counter()
        for _ in range(n):
            out = self.model(tok, use_cache=True, **{self.cache_arg: cache})
            cache, tok = out[self.cache_arg], out.logits[:, -1:].argmax(-1)
        return n / (time.perf_counter() - t0)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.model(torch.tensor([ids]), use_cache=True)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def first_tokens(self, prompts: list[list[int]]) -> float:
        t0 = time.perf_counter()
        out = self.model(torch.tensor(prompts), use_cache=True)  # equal lengths: no padding
        out.logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - t0


def run(args) -> dict:
    import transformers

    torch.set_num_threads(args.threads)
    spec = resolve_model(args.model, accept=("smollm2", "checkpoint"))
    ours = Ours(spec.folder, args.prefill_len + 64)
    theirs = Theirs(spec.folder)
    vocab = int(spec.config["vocab_size"])
    short = prompt(16, vocab, 1)
    long = prompt(args.prefill_len, vocab, 2)
    many = [prompt(20, vocab, 10 + i) for i in range(16)]
    sides = dict(graphexec=ours, transformers=theirs)
    for side in sides.values():  # warm: first calls allocate, probe GEMM sizes, load kernels
        side.decode(short, 2), side.prefill(long[:64]), side.first_tokens(many[:2])
    got: dict[str, dict[str, list[float]]] = {k: {} for k in sides}
    for _ in range(args.reps):
        for name, side in sides.items():
            r = got[name]
            r.setdefault("decode_tok_s", []).append(side.decode(short, args.decode_tokens))
            r.setdefault("prefill_s", []).append(side.prefill(long))
            r.setdefault("first_tokens_s", []).append(side.first_tokens(many))
            print(name, {k: round(v[-1], 3) for k, v in r.items()}, flush=True)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in got.items()}
    g, t = med["graphexec"], med["transformers"]
    return dict(
        device="cpu", cpu=cpu_name(), threads=args.threads, cores=os.cpu_count(),
        date=datetime.date.today().isoformat(), commit=git_commit(), torch=torch.__version__,
        transformers=transformers.__version__, graphexec=gx.__version__,
        model=args.label or spec.name, dtype="float32", decode_tokens=args.decode_tokens,
        products=ours.model.ops.linear.__self__.plan_counts(),  # RowMM: rows alone or calls
        decode_prompt=len(short),
        prefill_len=args.prefill_len, concurrent=dict(prompts=16, prompt_len=20),
        reps=args.reps, runs=got, median=med,
        ratio=dict(decode=g["decode_tok_s"] / t["decode_tok_s"],
                   prefill=t["prefill_s"] / g["prefill_s"]),
        targets=dict(decode=">= 1.0x", prefill=">= 0.5x", first_tokens_s="<= 2"),
    )  # fmt: skip


def write(result: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"step-cpu-{result['model']}-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def markdown(r: dict) -> str:
    g, t = r["median"]["graphexec"], r["median"]["transformers"]
    return "\n".join([
        f"{r['model']} float32 on {r['cpu']}, {r['threads']} torch threads "
        f"(medians of {r['reps']}); products: {r.get('products')}",
        "",
        "| measure | graphexec | transformers | ratio | target |",
        "|---|---|---|---|---|",
        f"| decode tokens/s (1 stream) | {g['decode_tok_s']:.2f} | {t['decode_tok_s']:.2f} "
        f"| {r['ratio']['decode']:.2f}x | >= 1.0x |",
        f"| prefill of {r['prefill_len']} tokens (s) | {g['prefill_s']:.2f} | "
        f"{t['prefill_s']:.2f} | {r['ratio']['prefill']:.2f}x | >= 0.5x |",
        f"| 16 x 20-token prompts: first tokens (s) | {g['first_tokens_s']:.2f} | "
        f"{t['first_tokens_s']:.2f} (one padded forward) | | <= 2 s |",
    ])  # fmt: skip
