"""serve's default context length (`--max-seq-len` unset): the model's own
(max_position_embeddings of its config), capped so that its static KV cache (every slot
holds max_seq_len positions, allocated at start) takes at most `KV_SHARE` of the memory
free beside the weights; `context_length` says which in one line for the log."""

from __future__ import annotations

import math
import os
from typing import Any

KV_SHARE = 0.5  # of the memory free beside the weights, at most, for the KV cache
BLOCK = 256  # a capped length is a multiple of it (the attention's key block)


def free_memory(device) -> int | None:
    """Bytes free for this process now: the GPU's free memory, or the host's available
    memory (MemAvailable; else the physical memory); None where unknown."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def context_length(cfg: dict[str, Any], itemsize: int, slots: int, free: int | None,
                   engines: int = 1) -> tuple[int, str]:  # fmt: skip
    """(max_seq_len, what the log says of it) for a Llama-family `cfg` whose weights and
    cache take `itemsize` bytes per element, `slots` cache rows (the executor's slots and
    its padding slot), `free` bytes free before loading (None: unknown, then 4096 at
    most), shared by `engines` engine processes."""
    from graphexec.checkpoints.hf_config import param_shapes

    own = int(cfg.get("max_position_embeddings", 4096))
    heads = int(cfg["num_attention_heads"])
    kv, hd = int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or 0)
    hd = hd or int(cfg["hidden_size"]) // heads
    per_position = int(cfg["num_hidden_layers"]) * 2 * kv * hd * itemsize * slots
    need = own * per_position
    if free is None:
        n = min(own, 4096)
        return n, (f"max_seq_len {n} (the model's own is {own}; free memory unknown, so at "
                   "most 4096; --max-seq-len N sets it)")  # fmt: skip
    weights = sum(math.prod(s) for s in param_shapes(cfg).values()) * itemsize
    budget = KV_SHARE * max(0, free // engines - weights)
    if need <= budget:
        return own, (f"max_seq_len {own}, the model's own (max_position_embeddings): its KV "
                     f"cache takes {_gb(need)} for {slots} slots")  # fmt: skip
    n = max(BLOCK, int(budget // per_position) // BLOCK * BLOCK)
    return n, (f"max_seq_len {n}, not the model's own {own}: that would take {_gb(need)} of KV "
               f"cache for {slots} slots, more than {KV_SHARE:.0%} of the {_gb(budget / KV_SHARE)}"
               " free beside the weights; --max-seq-len N or a smaller --max-batch-size "
               "change it")  # fmt: skip
