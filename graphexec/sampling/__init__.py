"""The sampler: processors, filters, the seeded draw and the logprobs writer."""

from graphexec.sampling.pipeline import sample_logits, sample_step
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

__all__ = ["SamplerOutput", "SamplingTensors", "sample_logits", "sample_step"]
