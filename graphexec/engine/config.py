"""EngineConfig: every `DecodeExecutor` option and its checks, in one frozen dataclass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphexec.engine.graphs import check_buckets, default_buckets
from graphexec.sampling.pipeline import BACKENDS
from graphexec.speculative.spec_config import SpeculativeConfig


def _int_at_least_1(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The executor's options (`DecodeExecutor(model, config, tokenizer=...)`, or the
    same names as keyword arguments).

    max_batch_size: requests that may run at once (one slot each).
    overlap: the pipelined step: `step()` launches step N + 1, then waits for step N by
        its event and returns N's outputs (one call late: the first call after an
        admission may return none; step until `idle` to drain), so the device never waits
        for the host's finish. False: each step is collected in the call that launched
        it. None (default): True on CUDA; False on the CPU, where the step's compute runs
        on the calling thread, so pipelining would only hold each output back a step.
        The same tokens, positions, logprobs and ends either way.
    blocking_wait: wait for a step's outputs asleep on its event (a blocking-sync CUDA
        event; default) where a later launch is queued behind it (the pipelined step): the
        wake-up then costs no device time, and on a host whose cores are all busy a thread
        that sleeps between steps is scheduled back sooner than one that spends its share
        spinning. A wait with nothing queued behind it (overlap off, a speculative step,
        a drain) spins either way: there a wake-up left the GPU idle about 170 us longer
        per step on an H200. False: always spin. The same tokens either way.
    device: "cuda" / "cpu" / a torch.device; None = CUDA when available.
    cuda_graphs: replay captured graphs (emulated without CUDA); False = always eager.
    buckets: graph batch sizes; default 1, 2, 4, 8, then multiples of 16 up to
        max_batch_size. Larger batches run as several chunks.
    backend: the sampler backend; None = "triton" on CUDA, "torch" elsewhere.
    max_logit_bias: the most logit_bias entries a request may carry.
    seed: seeds the generator of seeds for unseeded requests; None = OS entropy.
    sampler_config: the Triton sampler's `SamplerConfig` (None: its device preset).
    speculative: a `SpeculativeConfig` to verify drafts in every step (each request then
        emits 1 to K+1 tokens per step); None = one token per step.
    vocab_size: the ids that may be sampled; None = the tokenizer's vocabulary (or the
        model's without a tokenizer). A model whose vocab_size is larger (a padded
        embedding) has its extra columns dropped before sampling.
    detokenize: with a tokenizer, report each token's text (`RequestOutput.text`); stop
        strings need it.
    max_min_ids: the most bitmask words of ids one request's min_tokens holds back.
    prefill_budget: prompt tokens prefilled per step; a longer prompt is prefilled in
        chunks over several steps, so running streams never wait for more than this. (A
        model without `prefill_batch` gets whole prompts, one `prefill` each.)
    tp_group: a torch.distributed group of tensor-parallel ranks: the model's decode (and
        verify) return this rank's vocabulary slice (`distributed.vocab_slices`), sampled
        with `distributed.sample_step` (`tp_method`: "all_to_all", "vocab_parallel" or
        "auto"). Every rank runs its own executor with the same requests in the same
        order (grammar masks are filled on every rank: the same host work, no broadcast,
        since every rank draws the same tokens); speculation needs an n-gram drafter and
        verify="strict"; prompt_logprobs is not served.
    """

    max_batch_size: int = 256
    overlap: bool | None = None
    blocking_wait: bool = True
    device: torch.device | str | None = None
    cuda_graphs: bool = True
    buckets: Sequence[int] | None = None
    backend: str | None = None
    max_logit_bias: int = 16
    seed: int | None = None
    sampler_config: Any = None
    speculative: SpeculativeConfig | None = None
    vocab_size: int | None = None
    detokenize: bool = True
    max_min_ids: int = 16
    prefill_budget: int = 1024
    tp_group: Any = None
    tp_method: str = "auto"

    def __post_init__(self) -> None:
        _int_at_least_1("max_batch_size", self.max_batch_size)
        _int_at_least_1("prefill_budget", self.prefill_budget)
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool or None, got {self.overlap!r}")
        if not isinstance(self.blocking_wait, bool):
            raise ValueError(f"blocking_wait must be a bool, got {self.blocking_wait!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {self.backend!r}")
        sp = self.speculative
        if sp is not None and not isinstance(sp, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, got "
                             f"{type(sp).__name__}")  # fmt: skip
        self.graph_buckets  # noqa: B018 (checks the buckets)

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """The buckets, sorted (the default ones when None)."""
        return check_buckets(self.buckets or default_buckets(self.max_batch_size))

    @property
    def torch_device(self) -> torch.device:
        try:
            d = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be 'cuda', 'cpu' or a torch.device, got "
                             f"{self.device!r}") from e  # fmt: skip
        if d.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available "
                             "(use device='cpu')")  # fmt: skip
        return d

    @property
    def runs(self) -> int:
        """Tokens a row may emit per step: K + 1 with speculation, else 1."""
        return 1 if self.speculative is None else self.speculative.num_draft_tokens + 1

    def vocab_for(self, model, tokenizer) -> int:
        """The sampled vocabulary V for `model`; ValueError when the model cannot serve."""
        for attr in ("vocab_size", "max_seq_len", "bind", "prefill", "decode"):
            if not hasattr(model, attr):
                raise ValueError(f"model ({type(model).__name__}) has no {attr!r}: not a "
                                 "DecodeModel")  # fmt: skip
        if self.speculative is not None and not hasattr(model, "verify"):
            raise ValueError(f"speculative decoding needs {type(model).__name__}.verify")
        width = int(model.vocab_size)
        v = self.vocab_size
        if v is None:
            v = width if tokenizer is None else int(tokenizer.vocab_size)
        if not 1 <= v <= width:
            raise ValueError(f"vocab_size ({v}, the tokenizer's unless given) must be in [1, "
                             f"the model's vocab_size {width}]")  # fmt: skip
        return v
