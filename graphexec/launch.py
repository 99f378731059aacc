"""The device side of the executor's work, run on the stepping thread: capturing every
`GraphKey` (`capture_keys`), and per step launching each chunk of the batch plan
(`launch_chunks`: token masks up, slot ids written, the key's graph replayed or its step
run eagerly, outputs copied to pinned host memory without blocking). Functions of the
executor's state (`ex`), as `admission` is."""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from graphexec.batch import BatchPlan
from graphexec.graphs import GraphKey, all_keys
from graphexec.models.protocol import check_logits
from graphexec.sampling.tensors import SamplerOutput

log = logging.getLogger(__name__)


def capture_keys(ex, keys, progress: bool) -> None:
    """Warm up and capture `keys` (None: all of them), largest bucket first, into one
    shared pool; a key that fails is logged and served eagerly."""
    spec_ks = ex.spec.spec_ks if ex.spec else (0,)
    keys = sorted(keys or all_keys(ex.buckets, spec_ks), key=lambda k: -k.bucket)
    ex.slots.flush()
    ex._retire_plan()  # the slot ids buffer is about to hold padding
    ex.buffers.slot_ids.fill_(ex.slots.padding_slot)
    cuda = ex.device.type == "cuda"
    mem0 = torch.cuda.memory_reserved(ex.device) if cuda else 0
    t0 = time.perf_counter()
    # a real capture warms each key up, which checks the model's outputs; emulation
    # checks them once, on one padding row
    bad = None if ex.graphs.cuda else probe_model(ex)
    for key in tqdm(keys, desc="capture", unit="graph", disable=not progress):
        if key.bucket > ex.buckets[-1]:
            raise ValueError(f"key {key} has a bucket larger than the largest bucket")
        if key in ex.graphs.steps:
            continue
        if key.spec_k not in spec_ks:
            raise ValueError(f"key {key} has spec_k {key.spec_k}; this executor runs {spec_ks}")
        if bad is not None:
            ex.graphs.fail(key, bad)
        else:
            ex.graphs.capture(key, ex._step_fn(key))
    ex.slots.reset_padding()
    grew = torch.cuda.memory_reserved(ex.device) - mem0 if cuda else 0
    log.info(
        "captured %d graphs (%d failed) in %.1f s, reserved CUDA memory +%.1f MiB%s",
        len(ex.graphs.steps), len(ex.graphs.failed), time.perf_counter() - t0,
        grew / 2**20, "" if ex.graphs.cuda else " (emulated: no CUDA)",
    )  # fmt: skip


def probe_model(ex) -> str | None:
    """Why the model's decode (and verify) outputs are wrong, on one padding row."""
    m, w, pad = ex.model, ex.sampler.width(ex.model), ex.slots.padding_slot
    ids = torch.zeros(1, dtype=torch.int64, device=ex.device)
    slot = torch.full((1,), pad, dtype=torch.int64, device=ex.device)
    try:
        check_logits(m.decode(ids, ids, slot), (1, w), m, "decode")
        if ex.spec is not None:
            t = ex.spec.k + 1
            check_logits(m.verify(ids.expand(1, t), ids, slot), (1, t, w), m, "verify")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ex.slots.reset_padding()
    return None


def launch_chunks(ex, plan: BatchPlan, mode: str | None, errors: dict[int, str]) -> list:
    """Replay (or run eagerly) each chunk of the plan and queue its output copies;
    [(key, start, n)]. A chunk whose step raises is recorded in `errors`."""
    if plan.mask_rows and ex.spec is None:  # the runner writes masks per offset
        upload_masks(ex, [plan.rows[i].slot for i in plan.mask_rows])
    replay = mode != "eager" and ex.cuda_graphs
    keys = []
    for key, start, n in plan.chunks:
        if ex.spec is not None:
            key = ex.spec.prepare(plan, key, start, n, ex.masks)
        keys.append((key, start, n))
        if not plan.uploaded:
            host = ex._host_slots[start : start + key.bucket]
            host.fill_(ex.slots.padding_slot)
            host[:n] = torch.tensor([r.slot for r in plan.rows[start : start + n]])
        if not plan.uploaded or len(plan.chunks) > 1:
            src = ex._host_slots[start : start + key.bucket]
            ex.buffers.slot_ids[: key.bucket].copy_(src, non_blocking=True)
        try:
            if not (replay and ex.graphs.replay(key)):
                ex._eager[key] += 1
                ex._step_fn(key)()
        except Exception as e:  # the chunk's requests end; the executor goes on
            log.exception("step of %s failed; its %d requests end with 'error'", key, n)
            errors[start] = f"{type(e).__name__}: {e}"
            continue
        if ex.spec is not None:
            ex.spec.copy_out(key, start, n)
        else:
            copy_out(ex, ex.buffers.out, key, start, n)
    plan.uploaded = True
    return keys


def copy_out(ex, out: SamplerOutput, key: GraphKey, start: int, n: int) -> None:
    """Queue the copy of rows [:n] of `out` to the host buffers at `start`."""
    h = ex._host_out
    # token_ids is < 0 exactly where valid is False, so it alone tells both
    h.token_ids[start : start + n].copy_(out.token_ids[:n], non_blocking=True)
    if key.logprobs:
        for name in ("logprobs", "ranks", "top_logprobs", "top_token_ids"):
            getattr(h, name)[start : start + n].copy_(getattr(out, name)[:n], non_blocking=True)


def upload_masks(ex, g: list[int]) -> None:
    """Fill the mask rows of slots `g` on the host and copy them to the slots."""
    host_rows = ex.masks.fill(g)
    idx = ex._host_mask_idx[: len(g)]
    idx.copy_(torch.tensor(g, dtype=torch.int64))
    dev_idx = idx.to(ex.device, non_blocking=True)
    rows_dev = host_rows.to(ex.device, non_blocking=True)
    bm = ex.slots.bitmask
    (bm if bm.dim() == 2 else bm[:, 0]).index_copy_(0, dev_idx, rows_dev)
