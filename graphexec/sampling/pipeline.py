"""The sampler pipeline's two entry points.

`sample_step` is the tensor-level call the executor captures in a CUDA graph: every input
is a device tensor (the parameters in a per-slot `SamplingTensors` table) and the outputs
go into a preallocated `SamplerOutput`, so nothing allocates on the host's say-so and
nothing waits on the GPU. The variant and the logprobs width are static: they pick the
kernels, not the values (every variant gives a row it can serve the token `default`
gives it).

`sample_logits` is the convenience call over `SamplingParams`: it validates, builds a
one-slot-per-row table, allocates the outputs and calls `sample_step`. What both compute
is `graphexec.sampling.reference`'s definition.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphexec.params import SamplerVariant, SamplingParams, choose_variant
from graphexec.runtime.triton_env import interpreter_enabled
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

BACKENDS = ("torch", "triton", "flashinfer")
MAX_VOCAB = 1 << 21  # fixed-point mass stays below 2**53, exact in float64


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def sample_step(logits: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                table: SamplingTensors, out: SamplerOutput, bitmask: torch.Tensor | None = None,
                variant: SamplerVariant = SamplerVariant.DEFAULT, backend: str | None = None, *,
                config=None, workspace=None,
                count_ids: torch.Tensor | None = None) -> SamplerOutput:  # fmt: skip
    """Sample one token per row into `out`; CUDA-graph capturable with backend="triton".

    Args (as `sample_logits`'s, on the logits' device, but for these):
        logits: read as is (no upcast copy).
        slot_ids: [B] int64, row b's parameters are table row slot_ids[b].
        positions: [B] int64.
        table: per-slot parameters.
        out: preallocated outputs (`SamplerOutput.allocate(B, device, num_top)`); logprobs
            are written when out.logprobs is not None.
        variant: every row must be servable by it (the caller's job: `choose_variant`); an
            unservable row would be sampled without its filters.
        config: the Triton backend's `SamplerConfig` (None: its preset for the device);
            `config.draw_block` is part of the definition, so the torch backend takes it too.
        workspace: the Triton backend's scratch (`triton.sampler_config.Workspace`,
            allocated once for the largest batch and reused: no allocation or zeroing per
            call); None allocates one per call.
        count_ids: optional [B, NE] int64 ids that row b counts once more each on top
            of its slot's token counts (-1 = none; used only where the table has counts):
            speculative verification's drafts before an offset.

    CUDA graphs: with backend="triton" this issues only kernel launches on fixed buffers;
    capture it with static `logits`, `slot_ids`, `positions`, `bitmask` and `out`, and
    write new values into them (and into `table`) before each replay.
    """
    backend = backend or default_backend(logits.device)
    if backend == "torch":
        from graphexec.sampling import reference

        db = reference.DRAW_BLOCK if config is None else config.draw_block
        return reference.sample(logits, slot_ids, positions, table, out, bitmask, variant,
                                draw_block=db, count_ids=count_ids)  # fmt: skip
    if backend == "triton":
        from graphexec.sampling.triton import launch

        return launch.sample(logits, slot_ids, positions, table, out, bitmask, variant,
                             config=config, workspace=workspace, count_ids=count_ids)  # fmt: skip
    if backend == "flashinfer":
        from graphexec.sampling import flashinfer

        if count_ids is not None:
            raise ValueError("count_ids is not supported by backend 'flashinfer'")
        return flashinfer.sample(logits, slot_ids, positions, table, out, bitmask, variant)
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def _check_tensor(name: str, t: torch.Tensor | None, shape: tuple, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def sample_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  positions: Sequence[int] | torch.Tensor, token_counts: torch.Tensor | None = None,
                  prompt_mask: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                  variant: SamplerVariant | str | None = None,
                  backend: str | None = None) -> SamplerOutput:  # fmt: skip
    """Sample one token per row of `logits`, exactly and reproducibly.

    Args:
        logits: [B, V] float32 / bfloat16 / float16 tensor on any device.
        params: B `SamplingParams`, each with `seed` set.
        positions: [B] ints, the output position of the token being drawn; with the seed
            it keys the noise, so the same (row, params, seed, position) gives the same
            token in any batch.
        token_counts: optional [B, V] int counts of the tokens generated so far
            (presence / frequency / repetition penalties).
        prompt_mask: optional [B, V] bool, True where the token occurs in the prompt
            (repetition penalty).
        bitmask: optional [B, ceil(V/32)] int32 xgrammar token bitmask.
        variant: None = `choose_variant(params)`; or force one that serves every row.
        backend: None = "triton" on CUDA, "torch" elsewhere; or "flashinfer" (CUDA only,
            not batch-position invariant, see `graphexec.sampling.flashinfer`).

    Returns:
        `SamplerOutput`, its logprob fields set when any row set `logprobs` (top-N: N the
        largest `logprobs` asked).

    Example:
        >>> import torch, graphexec as gx
        >>> logits = torch.randn(2, 1000)
        >>> ps = [gx.SamplingParams(temperature=0.7, top_k=50, seed=1),
        ...       gx.SamplingParams(temperature=0.0, seed=2, logprobs=5)]
        >>> out = gx.sample_logits(logits, ps, positions=[0, 0])
        >>> out.token_ids.shape, out.top_logprobs.shape
        (torch.Size([2]), torch.Size([2, 5]))

    CUDA graphs: this call allocates its table and outputs; capture `sample_step`
    instead, over static buffers.
    """
    check_logits(logits, 2, "[B, V]")
    B, V = logits.shape
    dev = logits.device
    params, pos, token_counts, variant, backend = check_batch(
        B, V, dev, params, positions, token_counts, prompt_mask, variant, backend
    )
    _check_tensor("bitmask", bitmask, (B, (V + 31) // 32), dev)
    if bitmask is not None and bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if B == 0:
        return SamplerOutput.allocate(0, dev, None)
    table = SamplingTensors.from_params(params, V, dev, token_counts, prompt_mask)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    out = SamplerOutput.allocate(B, dev, max(asked) if asked else None)
    slot_ids = torch.arange(B, device=dev)
    return sample_step(logits, slot_ids, pos.to(dev), table, out, bitmask, variant, backend)


def check_logits(logits, dims: int, shape: str, name: str = "logits") -> None:
    """ValueError naming `name` unless it is a `dims`-D float32/bf16/fp16 tensor with a
    vocabulary (last dim) in [1, MAX_VOCAB]."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape}, got shape {list(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if not 0 < logits.shape[-1] <= MAX_VOCAB:
        raise ValueError(f"{name} vocabulary size must be in [1, {MAX_VOCAB}], "
                         f"got {logits.shape[-1]}")  # fmt: skip


def check_batch(B: int, V: int, dev: torch.device, params, positions, token_counts,
                prompt_mask, variant, backend):  # fmt: skip
    """Validate what `sample_logits` and `verify_drafts` share; returns (params as a list,
    positions [B] int64 on the CPU, token_counts as int32 or None, the variant, the
    backend). ValueError names the bad argument."""
    params = list(params)
    if len(params) != B:
        raise ValueError(f"params must hold one SamplingParams per row ({B}), got {len(params)}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
        if p.seed is None:
            raise ValueError(f"params[{i}].seed must be set for sample_logits")
    pos = torch.as_tensor(positions)
    if pos.numel() and (pos.dtype.is_floating_point or pos.dtype in (torch.bool, torch.complex64)):
        raise ValueError(f"positions must be integers, got {pos.dtype}")
    pos = pos.to(torch.int64)
    if pos.shape != (B,):
        raise ValueError(f"positions must have shape [{B}], got {list(pos.shape)}")
    if B and (int(pos.min()) < 0 or int(pos.max()) >= 2**32):
        raise ValueError("positions must be in [0, 2**32)")
    _check_tensor("token_counts", token_counts, (B, V), dev)
    _check_tensor("prompt_mask", prompt_mask, (B, V), dev)
    if token_counts is not None:
        if token_counts.dtype.is_floating_point or token_counts.dtype == torch.bool:
            raise ValueError(f"token_counts must be an integer tensor, got {token_counts.dtype}")
        token_counts = token_counts.to(torch.int32)
    if prompt_mask is not None and prompt_mask.dtype != torch.bool:
        raise ValueError(f"prompt_mask must be a bool tensor, got {prompt_mask.dtype}")
    if variant is None:
        variant = choose_variant(params)
    else:
        try:
            variant = SamplerVariant(variant)
        except ValueError:
            names = [v.value for v in SamplerVariant]
            raise ValueError(f"variant must be one of {names} or None, got {variant!r}") from None
        for i, p in enumerate(params):
            if not variant.serves(p):
                raise ValueError(f"variant {variant.value!r} cannot serve params[{i}] ({p})")
    backend = backend or default_backend(dev)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend in ("triton", "flashinfer") and dev.type != "cuda":
        if backend == "flashinfer" or not interpreter_enabled():
            raise ValueError(f"backend {backend!r} needs CUDA tensors (triton runs on the CPU "
                             "only under TRITON_INTERPRET=1)")  # fmt: skip
    return params, pos, token_counts, variant, backend
