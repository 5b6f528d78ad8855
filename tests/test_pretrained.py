"""Hugging Face GPT-2 weights into our GPT (CPU, no network): logits match transformers, overrides, errors that name
the keys, the offline hub error, the tokenizer a model directory names, init_from paths of ours that are no
checkpoint, and fine-tuning through the training loop with the finetune_gpt2 preset."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from model import GPT
from model.pretrained import PretrainedError, pretrained_encoding
from training.config import Config, register_configs
from training.init import resolve_init
from training.loop import train
from training.resume import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
register_configs()

needs_triton = pytest.mark.skipif(  # these tests run the kernel on CPU tensors, through the Triton interpreter
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1",
)


def hf_logits(hf_dir: Path, idx: torch.Tensor) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(hf_dir).eval()(idx).logits.detach()


@pytest.mark.parametrize("attention", ["naive", "sdpa", pytest.param("triton", marks=needs_triton)])
def test_logits_match_transformers(hf_gpt2_dir, attention):
    model = GPT.from_pretrained(str(hf_gpt2_dir), attention=attention).eval()
    assert model.config.vocab_size == 257 and model.config.pad_vocab_multiple == 1 and model.config.block_size == 64
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = model(idx)
    torch.testing.assert_close(logits, hf_logits(hf_gpt2_dir, idx), atol=1e-4, rtol=0)


def test_block_size_crop_and_dropout_override(hf_gpt2_dir):
    model = GPT.from_pretrained(str(hf_gpt2_dir), block_size=16, dropout=0.1).eval()
    assert model.config.block_size == 16 and model.transformer.wpe.weight.shape == (16, 32)
    assert model.config.dropout == 0.1 and model.transformer.h[0].mlp.dropout.p == 0.1
    assert all(p.requires_grad and p.device.type == "cpu" for p in model.parameters())
    idx = torch.randint(0, 257, (1, 16))
    with torch.no_grad():
        logits, _ = model(idx)
    torch.testing.assert_close(logits, hf_logits(hf_gpt2_dir, idx), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="checkpoint.s 64 positions"):
        GPT.from_pretrained(str(hf_gpt2_dir), block_size=65)
    with pytest.raises(ValueError, match=r"cannot override \['n_layer'\]"):
        GPT.from_pretrained(str(hf_gpt2_dir), n_layer=3)


def test_mismatched_weights_list_the_keys(hf_gpt2_dir, tmp_path):
    state = load_file(hf_gpt2_dir / "model.safetensors")
    del state["transformer.h.1.mlp.c_fc.bias"]
    state["transformer.h.0.attn.q_proj.weight"] = torch.zeros(32, 32)
    state["transformer.ln_f.weight"] = torch.ones(33)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((hf_gpt2_dir / "config.json").read_text())
    with pytest.raises(PretrainedError) as e:
        GPT.from_pretrained(str(tmp_path))
    message = str(e.value)
    assert "missing: transformer.h.1.mlp.c_fc.bias" in message
    assert "unexpected: transformer.h.0.attn.q_proj.weight" in message
    assert "transformer.ln_f.weight: checkpoint (33,) vs model (32,)" in message


def test_unsupported_configs_and_paths_are_named(hf_gpt2_dir, tmp_path):
    config = json.loads((hf_gpt2_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(PretrainedError, match="lacks model.safetensors"):
        GPT.from_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes((hf_gpt2_dir / "model.safetensors").read_bytes())
    with pytest.raises(PretrainedError, match="scale_attn_by_inverse_layer_idx=True"):
        GPT.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="gpt2-medium"):
        GPT.from_pretrained("gpt3")


@pytest.mark.parametrize("name, repo", [("gpt2", "openai-community/gpt2"),
                                        ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M")])
def test_unreachable_hub_fails_fast_naming_the_local_dir_alternative(tmp_path, name, repo):
    # A subprocess: huggingface_hub reads HF_HUB_OFFLINE and HF_HOME (an empty cache here) when it is imported.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = f"from model import GPT\nGPT.from_pretrained({name!r})"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 60
    assert f"HubUnavailableError: cannot download {repo}" in result.stderr
    assert "init_from=/path/to/model-dir" in result.stderr and "config.json" in result.stderr


def compose_cfg(tmp_path: Path, *overrides: str) -> Config:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["+experiment=finetune_gpt2", f"data.cache_dir={tmp_path / 'cache'}",
                                           "wandb.mode=disabled", "train.device=cpu", *overrides])
    return OmegaConf.to_object(cfg)


def test_training_loop_takes_shapes_and_weights_from_the_hf_dir(hf_gpt2_dir, tmp_path):
    cfg = compose_cfg(tmp_path, f"init_from={hf_gpt2_dir}", "model.block_size=32", "attention=naive")
    init = resolve_init(cfg)
    gpt_config = init.gpt_config
    assert (gpt_config.n_layer, gpt_config.n_embd, gpt_config.vocab_size) == (2, 32, 257)  # not the gpt2 preset's
    assert (gpt_config.block_size, gpt_config.dropout, gpt_config.attention) == (32, 0.1, "naive")
    model = init.model().eval()
    idx = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        logits, _ = model(idx)
    torch.testing.assert_close(logits, hf_logits(hf_gpt2_dir, idx), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="expected 'scratch'"):
        resolve_init(compose_cfg(tmp_path, "init_from=not-a-model"))


@pytest.mark.parametrize("config, tokenizer, expected", [
    ({"model_type": "gpt2"}, False, "gpt2"),  # a GPT-2 of the hub or of transformers
    ({"model_type": "gpt2", "flashgpt_encoding": "bytes"}, True, "bytes"),  # our exports: what the run used
    ({"model_type": "llama", "flashgpt_encoding": "cl100k_base"}, False, "cl100k_base"),
    ({"model_type": "gpt2", "flashgpt_encoding": "tokenizer.json"}, True, "{dir}"),
    ({"model_type": "llama"}, True, "{dir}"),
], ids=["gpt2", "ours-bytes", "ours-tiktoken", "ours-gpt2-tokenizer-json", "llama"])
def test_pretrained_encoding_is_what_our_export_recorded_else_gpt2_for_gpt2_else_the_tokenizer_json(
        tmp_path, config, tokenizer, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (tmp_path / "tokenizer.json").write_text("{}")
    assert pretrained_encoding(tmp_path) == expected.format(dir=tmp_path.resolve())


def test_init_from_a_path_of_ours_that_is_no_checkpoint_names_the_fix(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match=r"init_from=.*run is a run directory: point init_from at a checkpoint "
                                              r"\(this run saved none\)"):
        resolve_init(compose_cfg(tmp_path, f"init_from={run}"))
    (run / "checkpoints" / "best.pt").touch()
    (run / "checkpoints" / "last.pt").touch()
    with pytest.raises(CheckpointError, match=r"is a run directory: point init_from at one of its checkpoints: "
                                              r".*best.pt or .*last.pt$"):
        resolve_init(compose_cfg(tmp_path, f"init_from={run}"))
    (run / "checkpoints" / "last.dcp").mkdir()  # copied without its hidden .metadata, say
    (run / "checkpoints" / "last.dcp" / "__0_0.distcp").touch()
    with pytest.raises(CheckpointError, match=r"last.dcp: this sharded checkpoint directory lacks its .metadata file"):
        resolve_init(compose_cfg(tmp_path, f"init_from={run}/checkpoints/last.dcp"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"init_from='checkpoints/last.dcp': expected 'scratch', one of our "
                                         r"checkpoints \(a .pt file or .dcp directory; relative paths start at"):
        resolve_init(compose_cfg(tmp_path, "init_from=checkpoints/last.dcp"))  # not a hub id


def test_finetuning_lowers_val_loss(hf_gpt2_dir, tmp_path):
    lines = [f"The {c} cat sat on the {m} mat and looked at the {c} dog number {i}." for i in range(150)
             for c, m in [("black", "red"), ("white", "green")]]
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(lines))
    # The preset, on byte tokens (the random model's vocabulary), small and fast; a random model needs a larger LR.
    cfg = compose_cfg(tmp_path, f"init_from={hf_gpt2_dir}", f"data.data_files=[{text}]", "data.encoding=bytes",
                      "model.block_size=32", "train.batch_size=8", "train.grad_accum_steps=1", "train.max_steps=30",
                      "train.eval_interval=10", "train.eval_batches=4", "train.warmup_steps=2",
                      "train.learning_rate=3e-3", "train.perf_warmup_steps=2")
    run = tmp_path / "run"
    train(cfg, run, root=tmp_path)
    val = {m["step"]: m["val/loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "val/loss" in m}
    assert sorted(val) == [10, 20, 30] and val[30] < val[10] - 0.3, val
    assert (run / "checkpoints" / "best.pt").is_file()
