"""One `sample_step` call of the Triton sampler on CPU tensors with a GPU's shapes, for
`../shared/gpu/sass.py`, which compiles each kernel it launches for sm_90 without running it
and prints registers, spills and each loop's instruction mix:

    python ../shared/gpu/sass.py --out /tmp/s benchmarks/sass_sampler.py \
        [B] [VARIANT] [DTYPE] [V] [K=N ...]

B (default 128), VARIANT no_filter | top_k_top_p | default (default no_filter), DTYPE fp32 |
bf16 | fp16 (default fp32), V (default 128256: the row kernels' block vectors, unrolled per
thread, grow with its power of two); the GPU preset of `SamplerConfig`, but for the integer
knobs given as K=N (bins=128, tile_blocks=4, ...); logprobs=N: every row asks for the top N
(the logprobs writers launch too). The stats pass's main loop (its full
tiles) reads R * DB = 1,024 logits per iteration over 128 threads.
"""

import sys

import torch

from graphexec.params import SamplerVariant, SamplingParams
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import launch
from graphexec.sampling.triton.sampler_config import SamplerConfig

pos = [a for a in sys.argv[1:] if "=" not in a]
argv = pos + ["128", "no_filter", "fp32", "128256"][len(pos) :]
knobs = {k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[1:] if "=" in a)}
num_top = knobs.pop("logprobs", None)
B, V, variant = int(argv[0]), int(argv[3]), SamplerVariant(argv[1])
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[argv[2]]
filt = {} if variant is SamplerVariant.NO_FILTER else dict(top_k=50, top_p=0.9)
params = [SamplingParams(temperature=0.8, seed=i, logprobs=num_top, **filt) for i in range(B)]
table = SamplingTensors.from_params(params, V, "cpu")
launch.sample(torch.zeros(B, V, dtype=dtype), torch.arange(B), torch.zeros(B, dtype=torch.int64),
              table, SamplerOutput.allocate(B, "cpu", num_top), None, variant,
              config=SamplerConfig.gpu().replace(**knobs))  # fmt: skip
