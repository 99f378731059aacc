"""What a captured decode step runs besides the model's forward and the sampler
(`bench_step.py --model`, step_replay.py): the step graph and the forward graph, each
profiled over a few replays (`step_profile.kernel_spans`: each kernel's own time, what
it adds to the stream's timeline, and the idle gap before it), then the step's kernels
split into the forward (the forward graph's kernels, found as one run of the same names
in the step), the sampler (its Triton kernels by name, `engine.variants`), and the rest:
the step's own bookkeeping, masks and copies, the part issue targets hold to ~20 us.

Everything that touches CUDA runs inside functions: the module imports on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphexec.engine.variants import (
    TRITON_KERNELS,
    TRITON_LOGPROBS_KERNELS,
    TRITON_VERIFY_KERNELS,
)  # fmt: skip

SAMPLER_KERNELS = frozenset(k for ks in TRITON_KERNELS.values() for k in ks) | frozenset(
    TRITON_LOGPROBS_KERNELS + TRITON_VERIFY_KERNELS)  # fmt: skip


def split_step(spans: Sequence[tuple[str, float, float, float]], forward: Sequence[str],
               sampler: frozenset[str] = SAMPLER_KERNELS) -> dict:  # fmt: skip
    """The step's spans [(name, us, own us, gap us)] in launch order, split: forward = the
    first run of `forward`'s names in order (ValueError if none), sampler = kernels whose
    name starts with one in `sampler`, outside it; other = the rest outside it. Per part:
    own us, gap us (idle before its kernels), kernels; other's also by name (own us,
    largest first)."""
    names = [s[0] for s in spans]
    n = len(forward)
    start = next((i for i in range(len(names) - n + 1) if names[i:i + n] == list(forward)),
                 None)  # fmt: skip
    if start is None or n == 0:
        raise ValueError(f"the forward's {n} kernels are not one run in the step's "
                         f"{len(names)}")  # fmt: skip
    parts = {p: {"own_us": 0.0, "gap_us": 0.0, "kernels": 0}
             for p in ("forward", "sampler", "other")}  # fmt: skip
    by_name: dict[str, float] = {}
    for i, (name, _, own, gap) in enumerate(spans):
        part = ("forward" if start <= i < start + n else
                "sampler" if any(name.startswith(k) for k in sampler) else "other")  # fmt: skip
        parts[part]["own_us"] += own
        parts[part]["gap_us"] += gap
        parts[part]["kernels"] += 1
        if part == "other":
            by_name[name] = by_name.get(name, 0.0) + own
    parts["other"]["by_name"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1]))
    return parts


def step_parts(step_graph, forward_graph, reps: int = 5) -> dict:
    """`split_step` of the two captured graphs (CUDA), profiled `reps` replays each."""
    from step_profile import kernel_spans

    forward = [s[0] for s in kernel_spans(forward_graph, reps)]
    return split_step(kernel_spans(step_graph, reps), forward)
