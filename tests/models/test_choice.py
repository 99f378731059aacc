"""One way to name a model: every tool takes the same --model values (`models.choice`),
with one help text, and refuses an unknown one naming --model and the accepted values."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphexec.app import cli, determinism, inspection
from graphexec.models.choice import (
    MODEL_HELP,
    ModelChoiceError,
    accepted,
    config_names,
    resolve_model,
)
from graphexec.models.demo_model import choose_model
from graphexec.serve import server

ROOT = Path(__file__).resolve().parents[2]
ACCEPTED = ("smollm2", "tiny", "table", "a checkpoint folder PATH", "qwen2.5-0.5b")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from tests.text.test_hf_tokenizer import build_llama

    return build_llama(tmp_path_factory.mktemp("llama"))


def test_each_value_resolves_to_its_kind(checkpoint, tmp_path) -> None:
    assert resolve_model("tiny").kind == "tiny" and resolve_model("table").kind == "table"
    assert {"qwen2.5-0.5b", "llama-3.2-1b"} <= set(config_names())
    qwen = resolve_model("qwen2.5-0.5b")
    assert (qwen.kind, qwen.name, qwen.folder) == ("config", "qwen2.5-0.5b", None)
    assert qwen.config["model_type"] == "qwen2" and qwen.random_weights
    path = resolve_model(str(checkpoint))
    assert (path.kind, path.folder, path.name) == ("checkpoint", checkpoint, checkpoint.name)
    assert not path.random_weights and path.config["model_type"] == "llama"
    small = tmp_path / "small.json"  # a config .json by path: random weights at its shape
    small.write_text((checkpoint / "config.json").read_text())
    assert resolve_model(str(small)).kind == "config"
    with pytest.raises(ModelChoiceError, match="not supported by this tool"):
        resolve_model("table", accept=("tiny", "checkpoint"))


def test_smollm2_without_the_model_names_the_command(monkeypatch) -> None:
    from graphexec.checkpoints import smollm2

    def missing(*a, **k):
        raise smollm2.MissingExtraError("no smollm2 here: run THE COMMAND")

    monkeypatch.setattr(smollm2, "checkpoint", missing)
    with pytest.raises(ModelChoiceError, match="--model smollm2: .*THE COMMAND"):
        resolve_model("smollm2")


@pytest.mark.parametrize("value", ["nope", "qwen9", "./missing-folder"])
def test_an_unknown_value_is_refused_naming_the_field_and_the_accepted_values(value) -> None:
    with pytest.raises(ModelChoiceError) as e:
        resolve_model(value)
    msg = str(e.value)
    assert msg.startswith(f"--model {value!r}: ") and "\n" not in msg
    assert all(a in msg for a in ACCEPTED), msg
    assert all(a in accepted() for a in ACCEPTED)


def test_a_config_and_a_checkpoint_build_models_with_drafts(checkpoint, tmp_path) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["vocab_size"] = 100352  # room for cl100k: a config's prompts are cl100k's
    (tmp_path / "wide.json").write_text(json.dumps(cfg))
    cpu = torch.device("cpu")
    dm = choose_model(str(tmp_path / "wide.json"), cpu, max_seq_len=64)
    assert dm.random_weights and dm.tokenizer.name.startswith("cl100k")
    assert dm.make().num_layers == 2 and dm.draft().num_layers == 2
    dm = choose_model(str(checkpoint), cpu)
    draft = dm.draft()  # a truncated copy: its first layers, its own embedding and head
    assert draft.num_layers == 2 and torch.equal(draft.lm_head, dm.make().lm_head)
    assert "first 2 of 2 layers" in dm.draft_name


def _parsers() -> dict[str, argparse.ArgumentParser]:
    out = {}
    for name, add in (("inspect", inspection.add_arguments), ("serve", server.add_arguments),
                      ("determinism", determinism.add_arguments)):  # fmt: skip
        p = argparse.ArgumentParser()
        add(p)
        out[name] = p
    return out


def test_every_tool_documents_model_with_the_one_help_text() -> None:
    helps = {name: p.format_help() for name, p in _parsers().items()}
    demo = subprocess.run([sys.executable, "-m", "graphexec", "demo", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    helps["demo"] = demo.stdout
    squash = " ".join(MODEL_HELP.split())
    for name, text in helps.items():
        assert squash in " ".join(text.split()), name
    # every inspect flag says what it does
    for action in _parsers()["inspect"]._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize("cmd", ["demo", "inspect", "determinism", "serve"])
def test_each_subcommand_refuses_an_unknown_model(cmd, capsys, restore_threads) -> None:
    assert cli.main([cmd, "--model", "nope", "--device", "cpu", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert f"graphexec {cmd}: --model 'nope'" in err and "Traceback" not in err
    assert all(a in err for a in ACCEPTED), err


@pytest.mark.parametrize("tool", ["tools/determinism_check.py", "tools/inspect_graphs.py"])
def test_each_tool_script_refuses_an_unknown_model(tool) -> None:
    r = subprocess.run([sys.executable, tool, "--model", "nope", "--device", "cpu"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--model 'nope'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "qwen2.5-0.5b" in r.stderr


def test_inspect_runs_a_checkpoint_folder_and_a_config(checkpoint, capsys, tmp_path) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "wide.json").write_text(json.dumps(dict(cfg, vocab_size=100352)))
    for model in (str(checkpoint), str(tmp_path / "wide.json")):
        args = _parsers()["inspect"].parse_args(["--model", model, "--max-batch-size", "1",
                                                  "--device", "cpu"])  # fmt: skip
        assert inspection.inspect_graphs(args) == 0
        out = capsys.readouterr().out
        assert "no CUDA" in out and "keys; buckets [1]" in out


def test_inspect_counts_kernels_per_model_layer() -> None:
    from graphexec.app.inspection import kernels_per_layer

    layer = [("_residual_rms_norm_kernel", 2), ("_linear_kernel", 3), ("_linear_tma_kernel", 1),
             ("_rope_kv_write_kernel", 1), ("_decode_attention_kernel", 1)]  # fmt: skip
    # 16 layers of 8 kernels, the final norm and the LM head, plus the sampler's kernels
    graph = [(n, c * 16 + (1 if n in ("_linear_kernel", "_residual_rms_norm_kernel") else 0))
             for n, c in layer] + [("_sample_kernel", 3)]  # fmt: skip
    assert kernels_per_layer(graph, 16) == 8.0
    assert kernels_per_layer(graph, None) is None
    assert kernels_per_layer([("_sample_kernel", 3)], 16) is None
