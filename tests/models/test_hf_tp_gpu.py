"""HFTransformer with tp_group on several GPUs (NCCL), at T = the visible GPUs: the
Qwen2.5-0.5B and Llama-3.2-1B shapes (benchmarks/configs, random weights, bf16).

On every rank, every seeded request of a mixed workload gets the same tokens in one
batch (replayed: decode, verify and prefill captured in CUDA graphs, the model's
all-reduces inside them), alone, in waves, reversed, eager, in a second executor, and
with n-gram speculation (K = 3, strict) replayed and eager; and every rank gets the same
tokens. Logprobs to 1e-5 relative (the TP sampler's sums over slices may round
differently from one method to the other). A shape whose heads do not divide by T
(Qwen2.5-0.5B: 14 heads, 2 KV heads, at T = 4) is skipped: the constructor refuses it.

    CUDA_VISIBLE_DEVICES=0,1 python -m pytest -m gpu tests/models/test_hf_tp_gpu.py -s
    CUDA_VISIBLE_DEVICES=0,1,2,3 python -m pytest -m gpu tests/models/test_hf_tp_gpu.py -s
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import graphexec as gx
from graphexec.app import workload as wl
from graphexec.models import HFTransformer
from graphexec.models.hf_random import random_state_dict
from graphexec.models.hf_shard import check_divisible
from tests.distributed.arrangements import arrangements, same
from tests.distributed.ranks import WithNccl, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def items(vocab_size: int) -> list[wl.WorkItem]:
    """16 seeded requests of every kind (no grammars: no tokenizer) and two greedy ones
    on repetitive prompts, so the n-gram drafter proposes."""
    mixed = wl.mixed_workload(16, vocab_size, seed=1, spread=6, max_tokens=(8, 24),
                              unseeded_every=0, prompt_tokens=(1, 40))  # fmt: skip
    loops = [wl.WorkItem(f"loop{i}", tuple([7, 8, 9, 10] * 6),
                         gx.SamplingParams(temperature=0.0 if i else 0.8, seed=i,
                                           max_tokens=24), i, "loop")
             for i in range(2)]  # fmt: skip
    return mixed + loops


def _rank_streams(rank: int, world: int, cfg: dict, device: str = "cuda",
                  dtype: torch.dtype = torch.bfloat16, group=None) -> dict:  # fmt: skip
    """Every arrangement's streams on this rank (module docstring); `device` "cuda" is
    this rank's GPU."""
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device(device)
    # the same seeded weights on every rank (same device type); each model keeps its part
    weights = random_state_dict(cfg, seed=0, device=dev, dtype=dtype)
    work = items(int(cfg["vocab_size"]))

    def make(spec: bool) -> gx.DecodeExecutor:
        m = HFTransformer(cfg, weights, device=dev, dtype=dtype, max_seq_len=256,
                          tp_group=group)  # fmt: skip
        s = gx.SpeculativeConfig(3, drafter="ngram") if spec else None
        ex = gx.DecodeExecutor(m, max_batch_size=16, device=dev, seed=0, buckets=(1, 4, 16),
                               speculative=s, tp_group=group)  # fmt: skip
        ex.capture(progress=False)
        assert ex.stats.failed == {}, ex.stats.failed
        return ex

    return arrangements(make, work, waves=3)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.2-1b"])
def test_tp_streams_are_deterministic(name: str) -> None:
    world = min(torch.cuda.device_count(), 8)
    try:
        check_divisible(config(name), world)
    except ValueError as e:
        pytest.skip(f"{name} cannot be split over {world} GPUs: {e}")
    per_rank = run_ranks(world, WithNccl(_rank_streams), config(name), timeout=600)
    ref = per_rank[0]["one batch"]
    assert sum(len(v) for v in ref.values()) > 200
    for r, got in enumerate(per_rank):
        for arrangement, s in got.items():
            same(s, ref, f"{name}, T = {world}: rank {r}, {arrangement}")


def _calls(m: HFTransformer, dev: torch.device) -> list[torch.Tensor]:
    """Logits of a prompt-sized call (8 slots x 75 positions: 600 rows, above the
    symmetric buffers' cap), a decode (8 rows), a verify over 4 tokens of 4 slots (16
    rows) and one of 160 rows (large-M tiles, within the cap)."""
    g = torch.Generator(device=dev).manual_seed(5)
    out = []
    for slots, positions in ((range(8), range(75)), (range(8), range(75, 76)),
                             (range(4), range(76, 80)), (range(4), range(80, 120))):  # fmt: skip
        s = torch.tensor([a for a in slots for _ in positions], device=dev)
        p = torch.tensor([b for _ in slots for b in positions], device=dev)
        ids = torch.randint(0, m.vocab_size, (len(s),), device=dev, generator=g)
        out.append(m.decode(ids, p, s))
    return out


def _logits_at_this_world(rank: int, world: int, group=None) -> list[str]:
    """On each rank: the T = 1 model's logits, then the model sharded over the T = world
    ranks; the rank's vocabulary columns compared bit for bit."""
    dev = torch.device("cuda", rank)
    cfg = dict(config("llama-3.1-8b"), num_hidden_layers=2)
    weights = random_state_dict(cfg, seed=0, device=dev, dtype=torch.bfloat16)

    def model(g) -> HFTransformer:
        m = HFTransformer(cfg, weights, device=dev, dtype=torch.bfloat16, max_seq_len=256,
                          tp_group=g)  # fmt: skip
        m.bind(9, dev)
        return m

    want = _calls(model(None), dev)
    m = model(group)
    bad = [] if m.tp.tree is not None else ["no symmetric buffers"]
    lo, hi = m.vocab_slice
    for i, (got, ref) in enumerate(zip(_calls(m, dev), want, strict=True)):
        if not torch.equal(got, ref[:, lo:hi]):
            n = (got != ref[:, lo:hi]).sum().item()
            bad.append(f"call {i}: {n} logits differ from one GPU's")
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_logits_are_one_gpus_bits_at_every_world(world) -> None:
    """Llama-3.1-8B's width (2 layers, bf16): prefill-sized, decode, verify and large-M
    calls give rank r's vocabulary columns of one GPU's logits, bit for bit, at T = 2 and
    4 (column shards summing K as the whole weights do; row-parallel subtrees finished
    in the tree over symmetric memory, and over NCCL above its row cap)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    for r, bad in enumerate(run_ranks(world, WithNccl(_logits_at_this_world), timeout=300)):
        assert bad == [], f"T = {world}, rank {r}: {bad}"
