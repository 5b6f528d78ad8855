"""Tests of the data pipeline (data/): preparation, caching, the loader, and the errors that name their fix.

    python -m pytest tests/test_data.py -q

Everything is written under pytest's tmp_path; the network paths run for real against an unreachable network.
"""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from omegaconf import OmegaConf

from data import DataConfig, DataUnavailableError, PreparedData, TokenLoader, get_encoding, prepare_dataset
from data.tokenizers import EOT, byte_encoding

ROOT = Path(__file__).resolve().parents[1]
PARAGRAPHS = ["first paragraph\nline two", "second: é ✓ 日本", "a literal <|endoftext|> is plain text", "last\n"]


def text_config(tmp_path: Path, paragraphs: list[str], **overrides) -> DataConfig:
    """A local-text config over one file holding `paragraphs` (relative path, resolved against tmp_path)."""
    (tmp_path / "corpus.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    settings = dict(name="t", source="text", data_files=["corpus.txt"], encoding="bytes", val_fraction=0.25,
                    cache_dir="cache")
    return DataConfig(**(settings | overrides))


def documents(data: PreparedData, enc: tiktoken.Encoding) -> list[str]:
    """Decode both token files back into their documents (each ends with <|endoftext|>)."""
    docs = []
    for split in ("train", "val"):
        tokens = data.tokens(split)
        assert tokens[-1] == data.eot_token
        ends = np.flatnonzero(tokens == data.eot_token)  # split on the token, not the string: text may contain it
        starts = np.concatenate([[0], ends[:-1] + 1])
        docs += [enc.decode(tokens[start:end].tolist()) for start, end in zip(starts, ends, strict=True)]
    return docs


def fake_data(tmp_path: Path, n_train: int, n_val: int, vocab_size: int = 65_536) -> PreparedData:
    """Token files whose token i is i (mod 65536): every window shows where it starts."""
    for split, n in (("train", n_train), ("val", n_val)):
        (np.arange(n) % 65_536).astype(np.uint16).tofile(tmp_path / f"{split}.bin")
    meta = dict(encoding="fake", vocab_size=vocab_size, eot_token=0, dtype="uint16", n_train=n_train, n_val=n_val,
                max_token_id=min(max(n_train, n_val) - 1, 65_535))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return PreparedData.load(tmp_path)


# --- preparation -------------------------------------------------------------------------------------------------

def test_text_round_trip(tmp_path):
    data = prepare_dataset(text_config(tmp_path, PARAGRAPHS), root=tmp_path)
    assert data.dir.parent == tmp_path / "cache" and sorted(p.name for p in data.dir.iterdir()) == [
        "meta.json", "train.bin", "val.bin"]
    assert (data.vocab_size, data.eot_token, data.dtype, data.max_token_id) == (257, 256, "uint16", 256)
    assert data.tokens("train").dtype == np.uint16 and (data.n_train, data.n_val) == (
        len(data.tokens("train")), len(data.tokens("val")))
    # the split shuffles documents, so compare as multisets; the literal "<|endoftext|>" survives as text
    assert sorted(documents(data, byte_encoding())) == sorted(PARAGRAPHS)
    n_eot = sum(int((data.tokens(s) == data.eot_token).sum()) for s in ("train", "val"))
    assert n_eot == len(PARAGRAPHS) and json.loads((data.dir / "meta.json").read_text())["documents"]["val"] == 1


def test_uint32_for_vocab_over_65536(tmp_path, monkeypatch):
    # a real tiktoken encoding whose extra special token puts n_vocab past what uint16 holds
    base = byte_encoding()
    wide = tiktoken.Encoding("bytes_wide", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                             special_tokens={EOT: 256, "<|wide|>": 70_000})
    monkeypatch.setattr("data.prepare.get_encoding", lambda name: wide)
    data = prepare_dataset(text_config(tmp_path, PARAGRAPHS), root=tmp_path)
    assert (data.vocab_size, data.dtype, data.tokens("train").dtype) == (70_001, "uint32", np.uint32)
    assert sorted(documents(data, wide)) == sorted(PARAGRAPHS)


def test_cache_follows_the_settings(tmp_path):
    cfg = text_config(tmp_path, PARAGRAPHS)
    first = prepare_dataset(cfg, root=tmp_path)
    assert prepare_dataset(OmegaConf.structured(cfg), root=tmp_path).dir == first.dir  # a Hydra node works too
    assert prepare_dataset(text_config(tmp_path, PARAGRAPHS, val_fraction=0.5), root=tmp_path).dir != first.dir
    # editing the file re-prepares instead of reusing stale tokens
    assert prepare_dataset(text_config(tmp_path, [*PARAGRAPHS, "new"]), root=tmp_path).dir != first.dir


def test_stdlib_default_offline_and_cached(tmp_path, monkeypatch):
    preset = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(ROOT / "conf/data/stdlib.yaml"))
    cfg = OmegaConf.to_object(preset)
    cfg.cache_dir = str(tmp_path / "cache")  # absolute: root does not matter
    data = prepare_dataset(cfg)
    assert data.encoding == "bytes" and data.vocab_size == 257 and data.dtype == "uint16"
    assert 1_000_000 < data.n_train < 10_000_000 and 0.05 < data.n_val / (data.n_train + data.n_val) < 0.3
    val = data.tokens("val")[:20_000]
    text = bytes(val[val < 256].tolist()).decode(errors="replace")
    assert "def " in text and "import " in text
    mtimes = [p.stat().st_mtime_ns for p in sorted(data.dir.iterdir())]

    def no_reload(*args, **kwargs):
        raise AssertionError("a prepared folder must be reused, not prepared again")

    monkeypatch.setattr("data.prepare._load_documents", no_reload)
    again = prepare_dataset(cfg)
    assert again == data and [p.stat().st_mtime_ns for p in sorted(again.dir.iterdir())] == mtimes


def test_presets_merge_onto_the_schema_and_are_named_after_their_file():
    for preset in sorted((ROOT / "conf/data").glob("*.yaml")):
        node = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(preset))
        assert node.name == preset.stem


def test_local_text_preset_needs_files(tmp_path):
    raw = OmegaConf.load(ROOT / "conf/data/local_text.yaml")
    assert OmegaConf.is_missing(raw, "data_files")
    # merged onto the schema, OmegaConf keeps the schema's None for "???"; prepare then asks for the files
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), raw, {"cache_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"set data\.data_files=\["):
        prepare_dataset(cfg)


# --- loader ------------------------------------------------------------------------------------------------------

def test_next_batch_windows(tmp_path):
    data = fake_data(tmp_path, n_train=1000, n_val=200)
    loader = TokenLoader(data, block_size=16, batch_size=8, device="cpu", seed=0, vocab_size=65_536)
    for _ in range(20):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
        starts = x[:, :1]
        assert torch.equal(x, starts + torch.arange(16)) and torch.equal(y, x + 1)  # a window; y shifted by one
        assert (starts >= 0).all() and (starts + 17 <= 1000).all()


def test_eval_batches_sequential_and_deterministic(tmp_path):
    data = fake_data(tmp_path, n_train=1000, n_val=50)
    loader = TokenLoader(data, block_size=8, batch_size=4, device="cpu", seed=0)
    batches = list(loader.eval_batches("val", 2))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(batches, loader.eval_batches("val", 2), strict=True))
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == [0, 8, 16, 24, 32, 40 % 42, 48 % 42, 56 % 42]  # consecutive, wrapping over the 42 valid starts
    # two ranks split the same windows between them, every other one
    ranks = [TokenLoader(data, 8, 2, "cpu", 0, rank=r, world_size=2) for r in (0, 1)]
    (x0, _), (x1, _) = (next(r.eval_batches("val", 1)) for r in ranks)
    assert x0[:, 0].tolist() == [0, 16] and x1[:, 0].tolist() == [8, 24]


def test_state_dict_resumes_the_same_batches(tmp_path):
    data = fake_data(tmp_path, n_train=5000, n_val=100)
    run = TokenLoader(data, block_size=8, batch_size=4, device="cpu", seed=3)
    for _ in range(3):
        run.next_batch()
    buffer = io.BytesIO()
    torch.save(run.state_dict(), buffer)
    expected = [run.next_batch() for _ in range(2)]
    resumed = TokenLoader(data, block_size=8, batch_size=4, device="cpu", seed=0)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    for (x, y), (rx, ry) in zip(expected, (resumed.next_batch() for _ in range(2)), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_ranks_draw_different_batches(tmp_path):
    data = fake_data(tmp_path, n_train=5000, n_val=100)
    x0, _ = TokenLoader(data, 8, 4, "cpu", seed=0, rank=0, world_size=2).next_batch()
    x1, _ = TokenLoader(data, 8, 4, "cpu", seed=0, rank=1, world_size=2).next_batch()
    x0_again, _ = TokenLoader(data, 8, 4, "cpu", seed=0, rank=0, world_size=2).next_batch()
    assert not torch.equal(x0, x1) and torch.equal(x0, x0_again)
    # together they read the global batch of one rank with twice the batch size
    single, _ = TokenLoader(data, 8, 8, "cpu", seed=0).next_batch()
    assert torch.equal(torch.cat([x0, x1]), single)


@pytest.mark.gpu
def test_cuda_batches_match_cpu(tmp_path):
    data = fake_data(tmp_path, n_train=5000, n_val=100)
    cpu, cuda = (TokenLoader(data, 8, 4, device, seed=0) for device in ("cpu", "cuda"))
    (x, y), (cx, cy) = cpu.next_batch(), cuda.next_batch()
    assert cx.is_cuda and torch.equal(x, cx.cpu()) and torch.equal(y, cy.cpu())


# --- errors that name their fix ----------------------------------------------------------------------------------

def test_block_size_larger_than_a_split(tmp_path):
    data = fake_data(tmp_path, n_train=1000, n_val=20)
    with pytest.raises(ValueError, match=r"val split holds 20 tokens.*model\.block_size"):
        TokenLoader(data, block_size=20, batch_size=2, device="cpu", seed=0)


def test_batch_of_windows_larger_than_a_split(tmp_path):
    data = fake_data(tmp_path, n_train=1000, n_val=100)
    with pytest.raises(ValueError, match=r"val split holds 100 tokens, fewer than one batch.*train\.batch_size"):
        TokenLoader(data, block_size=20, batch_size=8, device="cpu", seed=0)
    TokenLoader(data, block_size=20, batch_size=4, device="cpu", seed=0)  # 4 × 20 + 1 tokens fit
    with pytest.raises(ValueError, match="world size"):
        TokenLoader(data, block_size=20, batch_size=4, device="cpu", seed=0, rank=1, world_size=2)


def test_token_ids_beyond_the_model_vocab(tmp_path):
    data = prepare_dataset(text_config(tmp_path, PARAGRAPHS), root=tmp_path)
    with pytest.raises(ValueError, match=r"ids up to 256.*model\.vocab_size"):
        TokenLoader(data, block_size=4, batch_size=2, device="cpu", seed=0, vocab_size=256)


def test_empty_data(tmp_path):
    with pytest.raises(ValueError, match=r"no text.*data\.data_files"):
        prepare_dataset(text_config(tmp_path, ["", "", ""]), root=tmp_path)
    with pytest.raises(ValueError, match=r"data\.data_files: no file matches 'missing\.txt'"):
        prepare_dataset(text_config(tmp_path, PARAGRAPHS, data_files=["missing.txt"]), root=tmp_path)


def test_damaged_token_files(tmp_path):
    data = prepare_dataset(text_config(tmp_path, PARAGRAPHS), root=tmp_path)
    train, val = data.dir / "train.bin", data.dir / "val.bin"
    train.write_bytes(train.read_bytes()[:-2])
    with pytest.raises(ValueError, match=f"{train}.*delete the folder"):
        TokenLoader(data, block_size=4, batch_size=2, device="cpu", seed=0)
    val.unlink()
    with pytest.raises(ValueError, match=f"{val} is missing.*delete the folder"):
        data.tokens("val")


def test_unreachable_tiktoken_files(tmp_path, monkeypatch):
    # an empty tiktoken cache and a proxy that refuses every connection: the download fails at once, network or not
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    for proxy in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")
    for exempt in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(exempt, raising=False)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget a gpt2 another test may have loaded
    get_encoding.cache_clear()
    with pytest.raises(DataUnavailableError, match=r"TIKTOKEN_CACHE_DIR.*data\.encoding=bytes"):
        prepare_dataset(text_config(tmp_path, PARAGRAPHS, encoding="gpt2"), root=tmp_path)
    get_encoding.cache_clear()


def test_unreachable_hub(tmp_path):
    # the Hub's offline switch is read at import, so the real preset runs in a fresh process, with an empty HF cache
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-m", "data", "--preset", "tinystories", "encoding=bytes", f"cache_dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "DataUnavailableError" in result.stderr and "roneneldan/TinyStories" in result.stderr
    assert "HF_HOME" in result.stderr and "HF_DATASETS_OFFLINE" in result.stderr and "data=local_text" in result.stderr
