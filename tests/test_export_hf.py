"""scripts/export_hf.py on CPU: runs trained here through our loop (a Llama-family and a GPT-2-family one from scratch,
and a fine-tune of a random transformers Llama that holds a tokenizer.json built here) are exported and loaded back
with transformers: equal logits, the tokenizer and its token ids carried over (a byte-level tokenizer.json for byte
runs), the run's encoding recorded for sample.py and train.py init_from, GPT-2 with grouped-query attention, and the
refusals (non-empty out dir, a file or a run directory as out dir, a path that is no checkpoint, a GPT-2 that
GPT2LMHeadModel cannot hold)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import sample
from data import get_encoding
from model import GPT, GPTConfig
from model.pretrained import pretrained_encoding
from scripts import export_hf
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import Config, register_configs
from training.init import resolve_init
from training.loop import train

ROOT = Path(__file__).resolve().parents[1]
register_configs()
SMALL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.batch_size=4",
         "data.max_documents=20", "train.eval_batches=1", "train.eval_interval=2", "train.max_steps=4",
         "train.warmup_steps=1", "train.log_interval=2", "wandb.mode=disabled"]
TEXT = "def héllo(wörld):\n    return 中文 + '🙂'  # a comment"


def make_cfg(cache: Path, *overrides: str) -> Config:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[*SMALL, f"data.cache_dir={cache}", *overrides])
    return OmegaConf.to_object(cfg)


def hf_llama_dir(path: Path) -> Path:
    """A random transformers Llama (bos 1, eos 0) with a byte-level BPE tokenizer.json of 300 tokens (< its vocab of
    320) learnt from a stdlib file, and a tokenizer_config.json naming its special tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|begin|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([Path(json.__file__).read_text()], trainer)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=64, bos_token_id=1,
                                 eos_token_id=0, tie_word_embeddings=False)).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|begin|>"}))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One trained run dir per kind: llama (llama-tiny from scratch), gpt2 (tiny), finetune (init_from the HF Llama)."""
    tmp = tmp_path_factory.mktemp("runs")
    overrides = {"llama": ["model=llama-tiny"], "gpt2": [],
                 "finetune": [f"init_from={hf_llama_dir(tmp / 'hf-llama')}"]}
    for name, extra in overrides.items():
        train(make_cfg(tmp / "cache", *extra), tmp / name, root=tmp)
    return {name: tmp / name for name in overrides}


def assert_same_logits(run: Path, out: Path, checkpoint: str = "checkpoints/best.pt") -> None:
    """The run's checkpoint in our GPT and the export in transformers give the same logits (fp32) on random ids."""
    from transformers import AutoModelForCausalLM

    state = load_checkpoint(run / checkpoint)
    ours = GPT(GPTConfig(**{**state["model_config"], "dropout": 0.0})).eval()
    ours.load_state_dict(state["model"])
    c = ours.config
    idx = torch.randint(0, c.vocab_size, (2, c.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(idx).logits
        torch.testing.assert_close(theirs, ours(idx)[0], atol=1e-4, rtol=0)


def changed_checkpoint(run: Path, out: Path, **model_config) -> Path:
    """A copy of the run's best checkpoint with these model shapes and fresh weights drawn wide (N(0, 0.5): logits
    that differ when a weight is misplaced), as if trained so."""
    state = load_checkpoint(run / "checkpoints" / "best.pt")
    state["model_config"] |= model_config
    torch.manual_seed(0)
    model = GPT(GPTConfig(**state["model_config"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    state["model"] = model.state_dict()
    save_checkpoint(state, out)
    return out


def test_cli_exports_a_llama_run_with_equal_logits_and_a_byte_tokenizer_of_the_same_ids(runs, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "llama-hf"
    result = subprocess.run([sys.executable, "scripts/export_hf.py", str(runs["llama"]), str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LlamaForCausalLM" in result.stdout and "best.pt" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["eos_token_id"] == 256
    assert config["flashgpt_encoding"] == "bytes"  # what sample.py and train.py tokenize it with
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert_same_logits(runs["llama"], out)
    text = TEXT + " . <|endoftext|>"  # non-ASCII, a space before "." (transformers 4 would "clean it up"), the EOT
    ids = get_encoding("bytes").encode(text, allowed_special="all")
    assert ids == [*(TEXT + " . ").encode(), 256]
    theirs = AutoTokenizer.from_pretrained(out)
    assert theirs(text)["input_ids"] == ids and theirs.decode(ids) == text and theirs.eos_token_id == 256
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == ids


def test_finetune_of_a_hf_llama_exports_its_tokenizer_files_and_token_ids(runs, tmp_path):
    from transformers import AutoTokenizer

    out = export_hf.main([str(runs["finetune"]), str(tmp_path / "out")])
    assert_same_logits(runs["finetune"], out)
    source = runs["finetune"].parent / "hf-llama"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 0)
    ours = get_encoding(load_checkpoint(runs["finetune"] / "checkpoints" / "best.pt")["config"]["data"]["encoding"])
    expected = ours.encode_ordinary_batch([TEXT])[0]
    assert len(expected) > 10 and expected == Tokenizer.from_file(str(source / "tokenizer.json")).encode(
        TEXT, add_special_tokens=False).ids
    assert AutoTokenizer.from_pretrained(out)(TEXT, add_special_tokens=False)["input_ids"] == expected


def test_byte_level_gpt2_export_samples_and_fine_tunes_with_the_byte_tokenizer(runs, tmp_path, capsys):
    out = export_hf.main([str(runs["gpt2"]), str(tmp_path / "out")])
    assert resolve_init(make_cfg(tmp_path / "cache", f"init_from={out}")).encoding == "bytes"  # train.py
    greedy = ["--prompt", "def ", "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    capsys.readouterr()
    sample.main(["--init-from", str(out), *greedy])
    exported = capsys.readouterr().out
    sample.main(["--init-from", str(runs["gpt2"] / "checkpoints" / "best.pt"), *greedy])
    assert exported == capsys.readouterr().out and exported.startswith("def ")


@pytest.mark.parametrize("encoding", ["gpt2", "r50k_base"])
def test_tiktoken_run_records_its_encoding_for_our_loaders_and_writes_no_tokenizer_files(runs, tmp_path, monkeypatch,
                                                                                          capsys, encoding):
    """Offline: tiktoken's files cannot be fetched, the name is still carried (never gpt2 for another encoding)."""
    state = load_checkpoint(runs["gpt2"] / "checkpoints" / "best.pt")
    state["config"]["data"]["encoding"] = encoding
    save_checkpoint(state, tmp_path / "run.pt")

    def offline(name: str) -> None:
        raise OSError(f"cannot fetch {name}'s BPE files")

    monkeypatch.setattr(export_hf, "get_encoding", offline)
    out = export_hf.main([str(tmp_path / "run.pt"), str(tmp_path / "out")])
    assert f"the tokenizer is tiktoken's {encoding!r}; no tokenizer files are written" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert pretrained_encoding(out) == encoding


@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_gpt2_with_grouped_query_attention_exports_with_its_key_value_heads_repeated(runs, tmp_path, n_kv_head):
    checkpoint = changed_checkpoint(runs["gpt2"], tmp_path / "gqa.pt", n_head=4, n_kv_head=n_kv_head)
    out = export_hf.main([str(checkpoint), str(tmp_path / "out")])
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["n_head"]) == (["GPT2LMHeadModel"], 4)
    assert_same_logits(tmp_path, out, checkpoint="gqa.pt")


def test_gpt2_that_gpt2lmheadmodel_cannot_hold_is_refused_in_one_line(runs, tmp_path):
    checkpoint = changed_checkpoint(runs["gpt2"], tmp_path / "untied.pt", tie_embeddings=False)
    with pytest.raises(SystemExit, match=r"^cannot export .*untied.pt: GPT2LMHeadModel cannot hold this GPT-2 model "
                                         r"\(tie_embeddings=False.*needs tie_embeddings=true"):
        export_hf.main([str(checkpoint), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_gpt2_run_exports_as_gpt2lmheadmodel_with_equal_logits(runs, tmp_path):
    out = export_hf.main([str(runs["gpt2"]), str(tmp_path / "out")])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert_same_logits(runs["gpt2"], out)


def test_bf16_export_halves_the_weights_and_loads_in_bf16(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    fp32 = export_hf.main([str(runs["gpt2"]), str(tmp_path / "fp32")])
    bf16 = export_hf.main([str(runs["gpt2"]), str(tmp_path / "bf16"), "--dtype", "bf16"])
    size = lambda out: (out / "model.safetensors").stat().st_size  # noqa: E731
    assert size(bf16) < 0.55 * size(fp32)
    config = json.loads((bf16 / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(bf16, dtype="auto").dtype == torch.bfloat16


def test_checkpoint_last_exports_last_pt(runs, tmp_path, capsys):
    export_hf.main([str(runs["gpt2"]), str(tmp_path / "out"), "--checkpoint", "last"])
    assert f"{runs['gpt2'] / 'checkpoints' / 'last.pt'} (step 4)" in capsys.readouterr().out


def test_refuses_a_non_empty_out_dir_unless_overwrite_which_removes_stale_tokenizer_files(runs, tmp_path):
    out = tmp_path / "out"
    export_hf.main([str(runs["finetune"]), str(out)])
    with pytest.raises(SystemExit, match="already exists and is not an empty directory.*--overwrite"):
        export_hf.main([str(runs["gpt2"]), str(out)])
    assert (out / "tokenizer.json").is_file()
    export_hf.main([str(runs["gpt2"]), str(out), "--overwrite"])  # a bytes run: the fine-tune's tokenizer must go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert get_encoding(str(out)).n_vocab == 257  # the byte tokenizer, not the fine-tune's 300 tokens
    assert_same_logits(runs["gpt2"], out)


@pytest.mark.parametrize("kind", ["file", "run-dir"])
def test_refuses_a_file_or_a_run_directory_as_out_dir_even_with_overwrite(runs, tmp_path, kind):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("notes")
    else:
        (out / ".hydra").mkdir(parents=True)
        (out / "checkpoints").mkdir()
    before = sorted(tmp_path.rglob("*"))
    message = "is a file, not a directory" if kind == "file" else r"is a run directory \(it holds checkpoints/ or"
    with pytest.raises(SystemExit, match=f"^{re.escape(str(out))} {message}.*choose another out_dir"):
        export_hf.main([str(runs["gpt2"]), str(out), "--overwrite"])
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("make", [lambda tmp: tmp, lambda tmp: tmp / "missing.pt"], ids=["empty-dir", "missing-file"])
def test_refuses_a_path_that_is_neither_a_checkpoint_nor_a_run_dir(tmp_path, make):
    with pytest.raises(SystemExit, match=r"neither a checkpoint \(.pt file, .dcp directory\) nor a run directory"):
        export_hf.main([str(make(tmp_path)), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_refuses_a_file_that_is_not_our_checkpoint(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="corrupt or not a checkpoint"):
        export_hf.main([str(tmp_path / "x.pt"), str(tmp_path / "out")])
