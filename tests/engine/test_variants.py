"""The kernels each variant launches, and the kernel names read from a graph's DOT."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch

import graphexec as gx
from graphexec.engine import variants
from graphexec.engine.graphs import dot_kernels, short_kernel_name
from graphexec.engine.variants import TRITON_KERNELS, TRITON_LOGPROBS_KERNELS, triton_kernels
from graphexec.params import SamplerVariant as SV

ROOT = Path(__file__).resolve().parents[2]


def test_each_variant_launches_its_own_kernels() -> None:
    assert len(set(TRITON_KERNELS.values())) == len(SV)
    # the filtered variant that serves top-k rows launches two kernels at any batch
    assert triton_kernels(SV.TOP_K_TOP_P, False) == ("_stats_kernel", "_topk_kernel")
    assert triton_kernels(SV.NO_FILTER, True) == (
        "_stats_kernel",
        "_tail_kernel",
        *TRITON_LOGPROBS_KERNELS,
    )
    spec = triton_kernels(SV.DEFAULT, False, spec_k=3)
    assert spec[0] == "_flatten_kernel" and spec[-1] == "_emit_kernel"


def _launched(path: str) -> set[str]:
    return set(re.findall(r"\b(_\w+_kernel)\[", (ROOT / path).read_text()))


def test_the_triton_kernel_list_names_what_launch_py_launches() -> None:
    """TRITON_KERNELS (graphexec/engine/variants.py) is the one list of the sampler's
    kernels for `inspect`: when sampling/triton/launch.py launches other kernels, update
    it there (and ROUTES, if a variant's kernels change)."""
    sampler = _launched("graphexec/sampling/triton/launch.py")
    general = _launched("graphexec/sampling/triton/logprobs.py")  # write_logprobs' writer
    verify = _launched("graphexec/speculative/verify_kernels.py")
    listed = {k for ks in TRITON_KERNELS.values() for k in ks} | set(TRITON_LOGPROBS_KERNELS)
    listed |= set(variants.DEFAULT_QUEUED)
    assert listed == sampler | general, "update TRITON_KERNELS in graphexec/engine/variants.py"
    assert set(variants.TRITON_VERIFY_KERNELS) <= verify


def test_top_k_top_p_gives_the_tokens_of_default() -> None:
    """sample_logits on the torch backend: every row top_k_top_p serves gets from its own
    variant (top-k first) exactly the token and logprobs that default gives it."""
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 4.0, 0.2):
        logits = torch.randn(12, 700, generator=g) * scale
        logits[3, 100:140] = 1.25  # ties across the top-k cut
        params = [gx.SamplingParams(seed=i, temperature=0.8, logprobs=3) if i % 4 == 0 else
                  gx.SamplingParams(temperature=(0.5, 1.0, 1.5)[i % 3], top_k=(5, 60, 1)[i % 3],
                                    top_p=(1.0, 0.9, 0.5)[i % 3], seed=i, logprobs=3)
                  for i in range(12)]  # fmt: skip
        assert gx.choose_variant(params) is SV.TOP_K_TOP_P
        own = gx.sample_logits(logits, params, [i % 5 for i in range(12)], variant="top_k_top_p")
        dflt = gx.sample_logits(logits, params, [i % 5 for i in range(12)], variant="default")
        assert torch.equal(own.token_ids, dflt.token_ids) and bool(own.valid.all())
        assert torch.equal(own.logprobs, dflt.logprobs)
        assert torch.equal(own.top_token_ids, dflt.top_token_ids)


DOT = r"""digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="solid" shape="record" label="{MEMSET
| {{ID | node handle | dptr} | {0 (topoId: 5) | 0x00007FC44A2F2FF0 | 0x00007FC46BE00000}}}"];

"graph_1_node_1"[style="bold" shape="record" label="{KERNEL
| {ID | 1 (topoId: 4) | FILL\<\<\<\{8,1,1\},128,0\>\>\>}
| {{node handle | func handle} | {0x00007FC44A2F36D0 | 0x000000000D55C270}}
| {cooperative | 0}
}"];

"graph_1_node_2"[style="bold" shape="record" label="{KERNEL
| {ID | 2 (topoId: 3) | _stats_kernel\<\<\<\{32,1,1\},\{128,1,1\},0\>\>\>}
}"];

"graph_1_node_3"[style="bold" shape="record" label="{KERNEL
| {ID | 3 (topoId: 2) | _select_kernel\<\<\<\{32,1,1\},\{128,1,1\},0\>\>\>}
}"];

"graph_1_node_4"[style="bold" shape="record" label="{KERNEL
| {ID | 4 (topoId: 1) | _select_kernel\<\<\<\{8,1,1\},\{128,1,1\},0\>\>\>}
}"];

"graph_1_node_5"[style="bold" shape="record" label="{KERNEL
| {ID | 5 (topoId: 0) | ampere_sgemm_128x64_nn\<\<\<\{16,10,4\},128,0\>\>\>}
}"];
"graph_1_node_0" -> "graph_1_node_1";
}
}
""".replace(
    "FILL",
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arr"
    "ayIPcLm1EEEEviT0_T1_",
)


def test_kernel_names_are_read_from_the_dot_and_counted() -> None:
    names = dot_kernels(DOT)
    assert names == Counter({"at::native::vectorized_elementwise_kernel": 1, "_stats_kernel": 1,
                             "_select_kernel": 2, "ampere_sgemm_128x64_nn": 1})  # fmt: skip
    assert list(names)[:2] == ["at::native::vectorized_elementwise_kernel", "_stats_kernel"]
    assert sum(names.values()) == len(re.findall(r"\bKERNEL\b", DOT))  # every kernel node
    assert dot_kernels(DOT.replace("| {ID | 5 (topoId: 0) |", "| {XX |"))["?"] == 1


def test_short_kernel_names() -> None:
    assert short_kernel_name("_Z15vectorAddKernelPfS_S_i") == "vectorAddKernel"
    assert short_kernel_name("_ZNK2at6native3fooEv") == "at::native::foo"
    assert short_kernel_name("_ZN7cutlass7Kernel2I43cutlass_80_simtEEvNT_6ParamsE") == (
        "cutlass::Kernel2"
    )
    assert short_kernel_name("_tail_kernel") == "_tail_kernel"
    assert short_kernel_name("_Zx") == "_Zx"
