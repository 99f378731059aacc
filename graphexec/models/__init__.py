"""Models the executor can drive: the `DecodeModel` protocol and its test/demo models."""

from graphexec.models.protocol import DecodeModel
from graphexec.models.table import TableModel

__all__ = ["DecodeModel", "TableModel"]
