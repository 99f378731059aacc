"""graphexec: a CUDA-graph-aware decode-step executor with exact, path-invariant sampling.

A request's token depends only on its processed logits row, its sampling parameters, its
seed and its output position: not on batch, bucket, row, variant, or eager vs replay.
"""

from graphexec import distributed, models
from graphexec.engine.async_executor import AsyncDecodeExecutor
from graphexec.engine.config import EngineConfig
from graphexec.engine.executor import DecodeExecutor
from graphexec.engine.executor_stats import ExecutorStats
from graphexec.engine.inbox import ExecutorFullError
from graphexec.models.protocol import ModelOutputError
from graphexec.params import SamplerVariant, SamplingParams, choose_variant
from graphexec.request import GraphKey, PromptLogprob, RequestOutput
from graphexec.sampling import SamplerOutput, SamplingTensors, sample_logits, sample_step
from graphexec.speculative import SpeculativeConfig, VerifyOutput, verify_drafts, verify_step
from graphexec.text.grammar import Grammar
from graphexec.text.tokenizer import Tokenizer

__version__ = "0.1.0"
# The definition of every seeded stream (`graphexec.sampling.reference`): a seeded request
# gets the same tokens from every release with the same STREAM_VERSION. 2: a filtered row
# draws its candidate unfiltered and keeps it when the filters do, else a fallback draw.
# 3: top-p's total of a top-k-off row is fixed point, a sum that no layout changes.
STREAM_VERSION = 3

__all__ = [
    "AsyncDecodeExecutor",
    "DecodeExecutor",
    "EngineConfig",
    "ExecutorFullError",
    "ExecutorStats",
    "RequestOutput",
    "STREAM_VERSION",
    "Grammar",
    "ModelOutputError",
    "PromptLogprob",
    "GraphKey",
    "SamplerOutput",
    "SamplerVariant",
    "SamplingParams",
    "SamplingTensors",
    "SpeculativeConfig",
    "Tokenizer",
    "VerifyOutput",
    "choose_variant",
    "distributed",
    "models",
    "sample_logits",
    "sample_step",
    "verify_drafts",
    "verify_step",
]
