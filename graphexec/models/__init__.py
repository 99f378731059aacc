"""Models the executor can drive: the `DecodeModel` protocol and its test/demo models."""

from graphexec.models.hf import HFTransformer
from graphexec.models.protocol import DecodeModel, PrefillBatch
from graphexec.models.table import TableModel
from graphexec.models.tiny_lm import TinyLM

__all__ = ["DecodeModel", "HFTransformer", "PrefillBatch", "TableModel", "TinyLM"]
