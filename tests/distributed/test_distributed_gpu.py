"""gx.distributed on CUDA with NCCL: both methods captured in a CUDA graph (one rank in
process; several ranks on a multi-GPU host, marked multigpu), tokens equal to one GPU's
gx.sample_logits on the full rows; the executor with tp_group and a sharded TinyLM."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import graphexec as gx
import graphexec.app.workload as wl
from tests.distributed.ranks import run_ranks

pytestmark = pytest.mark.gpu
P = gx.SamplingParams
V = 128256


def mixed(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 4).to(torch.bfloat16)
    pool = [P(temperature=0.0, logprobs=2), P(temperature=0.8, top_k=50, top_p=0.9),
            P(top_p=0.7, logprobs=5), P(min_p=0.1), P(temperature=1.0),
            P(top_k=20, repetition_penalty=1.2, logit_bias={64128: 3.0})]  # fmt: skip
    params = [pool[i % len(pool)].with_seed(seed * 1000 + i) for i in range(B)]
    return x, params, torch.randint(0, 500, (B,), generator=g)


def _capture_and_compare(rank: int, world: int, B: int, group=None) -> list[str]:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    x, params, pos = mixed(B, 7)
    x, pos = x.to(dev), pos.to(dev)
    full = {b: gx.sample_logits(x, params, pos, backend=b) for b in ("triton", "torch")}
    tp = gx.distributed.TensorParallel.create(group, V)
    lo, hi = tp.slice
    shard = x[:, lo:hi].contiguous()
    table = gx.SamplingTensors.from_params(params, V, dev)
    slots = torch.arange(B, device=dev)
    bad = []
    for method, ref in (("all_to_all", "triton"), ("vocab_parallel", "torch")):
        outs = [gx.SamplerOutput.allocate(B, dev, 5) for _ in range(2)]
        kw = dict(tp=tp, method=method)
        gx.distributed.sample_step(shard, slots, pos, table, outs[0], **kw)  # eager, warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gx.distributed.sample_step(shard, slots, pos, table, outs[1], **kw)
        outs[1].token_ids.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want = full[ref]
        for name, o in (("eager", outs[0]), ("replay", outs[1])):
            if not torch.equal(o.token_ids, want.token_ids):
                bad.append(f"{method} {name}: tokens differ from one GPU's {ref} sampler")
            top = want.top_token_ids[:, :2]
            if not torch.equal(o.top_token_ids[:, :2], top):
                bad.append(f"{method} {name}: top ids")
            ok = want.logprobs.isfinite()
            if not torch.allclose(o.logprobs[ok], want.logprobs[ok], rtol=1e-5, atol=1e-5):
                bad.append(f"{method} {name}: logprobs")
    return bad


def test_one_rank_nccl_capture_of_both_methods() -> None:
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 's')}", rank=0,
                                world_size=1)  # fmt: skip
        try:
            assert _capture_and_compare(0, 1, 64) == []
        finally:
            dist.destroy_process_group()


@pytest.mark.multigpu
def test_several_ranks_nccl_capture_of_both_methods() -> None:
    world = min(torch.cuda.device_count(), 4)
    for bad in run_ranks(world, _nccl(_capture_and_compare), 256):
        assert bad == []


class _nccl:
    """Run fn on a rank with its own NCCL group (run_ranks gives a gloo one)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, rank: int, world: int, *args):
        torch.cuda.set_device(rank)
        g = dist.new_group(backend="nccl")
        return self.fn(rank, world, *args, group=g)


def _executor_streams(rank: int, world: int, spec: bool, group=None) -> dict:
    torch.cuda.set_device(rank)
    tok = gx.Tokenizer.cl100k()
    m = gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=128, shard=(rank, world))
    s = gx.SpeculativeConfig(3, drafter="ngram") if spec else None
    ex = gx.DecodeExecutor(m, max_batch_size=16, device=f"cuda:{rank}", tokenizer=tok,
                           seed=0, speculative=s, tp_group=group)  # fmt: skip
    ex.capture(progress=False)
    # every request seeded: the executor draws an unseeded request's seed from its own
    # generator, so a second run on one executor gives those requests other seeds
    items = wl.mixed_workload(24, tok.vocab_size, seed=5, grammars=True, spread=8,
                              unseeded_every=0)  # fmt: skip
    out = {}
    for mode in (None, "eager"):  # one executor: its slots are freed between the runs
        trace = wl.run(ex, items, mode=mode)
        out[mode] = {r: [o.token_id for o in v] for r, v in sorted(trace.outputs.items())}
    return out


@pytest.mark.multigpu
@pytest.mark.parametrize("spec", [False, True])
def test_executor_with_tp_group_equals_one_gpu(spec: bool) -> None:
    tok = gx.Tokenizer.cl100k()
    s = gx.SpeculativeConfig(3, drafter="ngram") if spec else None
    ex = gx.DecodeExecutor(gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=128),
                           max_batch_size=16, device="cuda", tokenizer=tok, seed=0,
                           speculative=s)  # fmt: skip
    ex.capture(progress=False)
    # every request seeded: the executor draws an unseeded request's seed from its own
    # generator, so a second run on one executor gives those requests other seeds
    items = wl.mixed_workload(24, tok.vocab_size, seed=5, grammars=True, spread=8,
                              unseeded_every=0)  # fmt: skip
    trace = wl.run(ex, items)
    want = {r: [o.token_id for o in v] for r, v in sorted(trace.outputs.items())}
    world = min(torch.cuda.device_count(), 4)
    for got in run_ranks(world, _nccl(_executor_streams), spec, timeout=600):
        assert got[None] == got["eager"]
        assert got[None] == want
