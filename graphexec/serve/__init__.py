"""An OpenAI-compatible server over `AsyncDecodeExecutor` (`python -m graphexec serve`).

In-process: `build_app(executor, ServedModel(...), max_queue)` returns the Starlette app;
`served_model(demo_model, path, name, max_seq_len)` makes the ServedModel of a DemoModel.
"""

from graphexec.serve.app import ServedModel, build_app
from graphexec.serve.served import served_model

__all__ = ["ServedModel", "build_app", "served_model"]
