"""serve's default context: the model's own, capped by the memory its KV cache takes."""

from __future__ import annotations

import json

from graphexec.serve.context import context_length
from graphexec.serve.served import build_executor
from graphexec.serve.server import engine_spec

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "max_position_embeddings": 8192, "vocab_size": 49152, "model_type": "llama"}  # fmt: skip
GIB = 2**30


def test_the_models_own_context_when_memory_allows_else_capped_and_said() -> None:
    # float32, 16 slots + padding: 30 x 2 x 3 x 64 x 4 x 17 bytes a position, 6.0 GiB at 8192
    n, note = context_length(SMOLLM2, 4, 17, free=64 * GIB)
    assert n == 8192 and "the model's own" in note and "6.0 GiB" in note
    n, note = context_length(SMOLLM2, 4, 17, free=8 * GIB)
    assert 2048 <= n < 8192 and n % 256 == 0
    assert f"max_seq_len {n}, not the model's own 8192" in note and "--max-seq-len" in note
    # two engines on one host share it
    assert context_length(SMOLLM2, 4, 17, free=8 * GIB, engines=2)[0] < n
    assert context_length(SMOLLM2, 4, 17, free=None)[0] == 4096
    assert context_length({**SMOLLM2, "max_position_embeddings": 2048}, 4, 17, None)[0] == 2048


def test_serve_runs_a_checkpoint_at_its_own_context(checkpoint, caplog) -> None:
    """The served checkpoint's config says 2048 positions: serve takes them all (the CPU
    default of the other tools is 1024), and logs why."""
    import argparse
    import logging

    assert json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"] == 2048
    args = argparse.Namespace(model=str(checkpoint), device="cpu", dtype="auto",
                              max_batch_size=2, max_seq_len=None, seed=0, speculative=None,
                              no_capture=True, max_queue=None, threads=1, log_level="info",
                              capture_keys=None)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="graphexec.serve"):
        ex, _ = build_executor(engine_spec(args))
    assert ex.model.max_seq_len == 2048
    assert any("max_seq_len 2048, the model's own" in r.getMessage() for r in caplog.records)
    args.max_seq_len = 512
    assert build_executor(engine_spec(args))[0].model.max_seq_len == 512
