"""Tests of the data pipeline (data/): preparation, caching, the loader, tokenizers, and the errors that name their fix.

    python -m pytest tests/test_data.py -q

Everything is written under pytest's tmp_path; the network paths run for real against an unreachable network. The
Hugging Face tokenizers are trained here, on a few lines of text, with the `tokenizers` library: no Hub download.
"""

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from data import DataConfig, DataUnavailableError, PreparedData, TokenLoader, get_encoding, prepare_dataset
from data.tokenizers import EOT, Encoding, HFTokenizer, byte_encoding, stream_decoder
from training.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
PARAGRAPHS = ["first paragraph\nline two", "second: é ✓ 日本", "a literal <|endoftext|> is plain text", "last\n"]


def text_config(tmp_path: Path, paragraphs: list[str], **overrides) -> DataConfig:
    """A local-text config over one file holding `paragraphs` (relative path, resolved against tmp_path)."""
    (tmp_path / "corpus.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    settings = dict(name="t", source="text", data_files=["corpus.txt"], encoding="bytes", val_fraction=0.25,
                    cache_dir="cache")
    return DataConfig(**(settings | overrides))


def documents(data: PreparedData, enc: Encoding) -> list[str]:
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


# 🙂 is in none of PARAGRAPHS, so the tokenizers trained on them spell it with four byte tokens
TEXT = "héllo wörld: 中文 and 🙂, a literal <|endoftext|>\n  indented"


def byte_level_bpe(vocab_size: int = 300, special_tokens: tuple[str, ...] = (EOT,)) -> Tokenizer:
    """A GPT-2/Qwen/SmolLM-style tokenizer: byte-level BPE whose merges are learnt from PARAGRAPHS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(PARAGRAPHS * 10, trainer)
    return tokenizer


def sentencepiece_bpe() -> Tokenizer:
    """A Llama-2/TinyLlama-style tokenizer: "▁" for spaces, byte fallback (<0xF0>, ...) for characters it has not
    learnt, and a <s> its post-processor puts in front of prompts."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    # the byte tokens are listed as special tokens only because the trainer takes no other fixed tokens
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tokenizer.train_from_iterator(PARAGRAPHS * 10, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return tokenizer


def save(tokenizer: Tokenizer, folder: Path, **side_files: dict) -> Path:
    """A model folder: tokenizer.json, and <key>.json for each keyword (tokenizer_config={"eos_token": "</s>"})."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    for name, content in side_files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder / "tokenizer.json"


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


def tail_text(n: int) -> str:
    """n characters of ASCII text in paragraphs, every position recognisable: "0000 0001 0002 0003\n\n0004 ..."."""
    return "".join(f"{i:04d}" + ("\n\n" if i % 4 == 3 else " ") for i in range(n))[:n]


def test_tail_split_holds_out_the_end_of_the_text_as_nanogpt(tmp_path):
    # 114 characters: 0.9 × 114 = 102.6, and nanoGPT's int() keeps 102 for train where round() would keep 103
    text = tail_text(114)
    (tmp_path / "input.txt").write_text(text, encoding="ascii")
    cfg = DataConfig(name="t", source="text", data_files=["input.txt"], encoding="bytes", val_split="tail",
                     cache_dir="cache")
    data = prepare_dataset(cfg, root=tmp_path)
    assert (data.n_train, data.n_val) == (102, 12)
    # byte tokens are exactly the file's characters: no <|endoftext|> anywhere, the blank lines kept
    assert bytes(data.tokens("train").tolist()) == text[:102].encode()
    assert bytes(data.tokens("val").tolist()) == text[102:].encode()
    assert data.max_token_id == ord(max(text))  # the end-of-text token, absent, does not count
    assert json.loads((data.dir / "meta.json").read_text())["documents"] == {"total": 1}
    assert prepare_dataset(cfg, root=tmp_path).dir == data.dir
    # the split is part of the cache's hash: the paragraph split prepares its own folder
    documents = prepare_dataset(replace(cfg, val_split="documents"), root=tmp_path)
    paragraphs = text.split("\n\n")  # that split drops the blank lines and ends each paragraph with <|endoftext|>
    assert documents.dir != data.dir and documents.n_train + documents.n_val == sum(len(p) + 1 for p in paragraphs)


def test_tail_split_joins_the_files_in_the_given_order_with_end_of_text_between(tmp_path):
    parts = {"b.txt": "second file, first in the list\n\nwith a paragraph", "a.txt": "ünïcode: bytes ≠ chars\n"}
    for name, text in parts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    cfg = DataConfig(name="t", source="text", data_files=list(parts), encoding="bytes", val_split="tail",
                     val_fraction=0.25, num_proc=2, cache_dir="cache")
    data = prepare_dataset(cfg, root=tmp_path)
    stream = [*parts["b.txt"].encode(), data.eot_token, *parts["a.txt"].encode()]  # no <|endoftext|> at the end
    n_train = int(0.75 * len(stream))
    assert data.tokens("train").tolist() == stream[:n_train] and data.tokens("val").tolist() == stream[n_train:]
    assert data.max_token_id == data.eot_token


def test_unknown_val_split_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"data\.val_split='last': use documents or tail"):
        prepare_dataset(text_config(tmp_path, PARAGRAPHS, val_split="last"), root=tmp_path)


def test_shakespeare_char_preset_is_nanogpts_config_with_the_tail_split(tmp_path):
    register_configs()
    (tmp_path / "input.txt").write_text(tail_text(20_000), encoding="ascii")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides=[
            "+experiment=shakespeare_char", f"data.data_files=[{tmp_path / 'input.txt'}]",
            f"data.cache_dir={tmp_path / 'cache'}"]))
    model, train = cfg.model, cfg.train
    assert (model.family, model.n_layer, model.n_head, model.n_embd, model.block_size, model.dropout, model.bias) == (
        "gpt2", 6, 6, 384, 256, 0.2, False)
    assert (train.batch_size, train.grad_accum_steps, train.max_steps, train.lr_decay_steps) == (64, 1, 5000, 5000)
    assert (train.learning_rate, train.min_lr_ratio, train.warmup_steps) == (1e-3, 0.1, 100)
    assert (train.beta1, train.beta2, train.weight_decay, train.grad_clip) == (0.9, 0.99, 0.1, 1.0)
    assert (train.eval_interval, train.eval_batches, train.log_interval) == (250, 200, 10)
    assert (cfg.attention.name, train.compile, cfg.init_from) == ("sdpa", False, "scratch")  # the user's to choose
    assert (cfg.data.source, cfg.data.encoding, cfg.data.val_split, cfg.data.val_fraction) == (
        "text", "bytes", "tail", 0.1)
    data = prepare_dataset(cfg.data)
    assert (data.n_train, data.n_val) == (18_000, 2_000) and data.dir.name.startswith("shakespeare_char-")


def test_prepare_with_a_tokenizer_json_decodes_back_and_follows_the_file(tmp_path):
    path = save(byte_level_bpe(), tmp_path / "model")
    cfg = text_config(tmp_path, PARAGRAPHS, encoding=str(path), num_proc=2)
    data = prepare_dataset(cfg, root=tmp_path)
    enc = get_encoding(str(path))
    assert (data.encoding, data.vocab_size, data.eot_token, data.dtype) == (str(path), enc.n_vocab, enc.eot_token,
                                                                            "uint16")
    # one separator per document: the literal "<|endoftext|>" stayed text, in datasets' worker processes too
    assert sorted(documents(data, enc)) == sorted(PARAGRAPHS)
    assert prepare_dataset(cfg, root=tmp_path).dir == data.dir
    # another tokenizer under the same path prepares a new folder, with its own tokens
    save(byte_level_bpe(vocab_size=280), tmp_path / "model")
    again = prepare_dataset(cfg, root=tmp_path)
    assert again.dir != data.dir and again.n_train + again.n_val != data.n_train + data.n_val
    assert sorted(documents(again, get_encoding(str(path)))) == sorted(PARAGRAPHS)


def test_uint32_for_a_tokenizer_json_over_65536_tokens(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["</s>"])  # id 70001, named by config.json's eos_token_id as in a model folder
    save(tokenizer, tmp_path / "model", config={"eos_token_id": 70_001})
    words = ["w1 w69999 w65536", "w0 w2", "w70 w7 w700", "w65535 w3"]
    data = prepare_dataset(text_config(tmp_path, words, encoding=str(tmp_path / "model")), root=tmp_path)
    assert (data.vocab_size, data.eot_token, data.dtype, data.max_token_id) == (70_002, 70_001, "uint32", 70_001)
    assert data.tokens("train").dtype == np.uint32
    assert sorted(documents(data, get_encoding(str(tmp_path / "model")))) == sorted(words)


# --- tokenizers --------------------------------------------------------------------------------------------------

def test_tokenizer_json_loads_from_the_file_or_its_model_folder_once(tmp_path):
    path = save(byte_level_bpe(), tmp_path / "model")
    by_file, by_folder = get_encoding(str(path)), get_encoding(str(tmp_path / "model"))
    assert isinstance(by_file, HFTokenizer) and (by_file.name, by_folder.name) == (str(path), str(tmp_path / "model"))
    reference = Tokenizer.from_file(str(path))
    assert by_file.n_vocab == by_folder.n_vocab == reference.get_vocab_size() == 300
    assert by_file.eot_token == by_folder.eot_token == reference.token_to_id(EOT)
    assert get_encoding(str(path)) is by_file


def test_tokenizer_json_linked_from_a_cache_snapshot_reads_the_files_beside_the_link(tmp_path):
    # The Hugging Face cache: snapshots/<rev>/tokenizer.json links into blobs/, tokenizer_config.json sits beside it.
    save(byte_level_bpe(special_tokens=(EOT, "<|im_end|>")), tmp_path / "blobs")
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "blobs" / "tokenizer.json")
    (snapshot / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    enc = get_encoding(str(snapshot))
    assert enc.eot_token == Tokenizer.from_file(str(snapshot / "tokenizer.json")).token_to_id("<|im_end|>") != 0


def test_eot_comes_from_tokenizer_config_then_config_then_known_names(tmp_path):
    tokenizer = byte_level_bpe(special_tokens=("<s>", "</s>", "<|im_end|>", EOT))
    ids = {token: tokenizer.token_to_id(token) for token in ("<s>", "</s>", "<|im_end|>", EOT)}
    cases = {  # the side files next to tokenizer.json -> the token that ends documents
        "string": ({"tokenizer_config": {"eos_token": "</s>"}, "config": {"eos_token_id": ids["<|im_end|>"]}}, "</s>"),
        "AddedToken": ({"tokenizer_config": {"eos_token": {"content": "<s>", "lstrip": False}}}, "<s>"),
        "config": ({"tokenizer_config": {"eos_token": None}, "config": {"eos_token_id": ids["<|im_end|>"]}},
                   "<|im_end|>"),
        "config list": ({"config": {"eos_token_id": [ids["</s>"], ids[EOT]]}}, "</s>"),
        "known names": ({}, EOT),  # <|endoftext|> comes before </s> and <|im_end|>
    }
    for case, (side_files, eot) in cases.items():
        assert get_encoding(str(save(tokenizer, tmp_path / case, **side_files))).eot_token == ids[eot], case
    path = save(byte_level_bpe(special_tokens=("<|im_end|>", "</s>")), tmp_path / "no-endoftext")
    assert get_encoding(str(path)).eot_token == Tokenizer.from_file(str(path)).token_to_id("</s>")
    # editing the side file loads the tokenizer again
    (tmp_path / "string" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert get_encoding(str(tmp_path / "string")).eot_token == ids["<|im_end|>"]


def test_tokenizer_json_round_trips_text_and_adds_special_tokens_only_to_prompts(tmp_path):
    bpe = get_encoding(str(save(byte_level_bpe(), tmp_path / "bpe")))
    sp = get_encoding(str(save(sentencepiece_bpe(), tmp_path / "sp", tokenizer_config={"eos_token": "</s>"})))
    bos = Tokenizer.from_file(str(tmp_path / "sp" / "tokenizer.json")).token_to_id("<s>")
    for enc in (bpe, sp):
        ordinary = enc.encode_ordinary_batch([TEXT, "é"])
        assert [enc.decode(ids) for ids in ordinary] == [TEXT, "é"]
        assert enc.eot_token not in ordinary[0] and bos not in ordinary[0]  # "<|endoftext|>" is plain text here
    # prompts: special-token text is the special token, and the post-processor's tokens are added
    assert bpe.encode(TEXT).count(bpe.eot_token) == 1 and bpe.decode(bpe.encode(TEXT)) == TEXT
    assert sp.encode(TEXT)[0] == bos and sp.encode(TEXT)[1:] == sp.encode_ordinary_batch([TEXT])[0]


def test_stream_decoder_returns_the_decoded_text_token_by_token(tmp_path):
    bpe = get_encoding(str(save(byte_level_bpe(), tmp_path / "bpe")))
    sp = get_encoding(str(save(sentencepiece_bpe(), tmp_path / "sp", tokenizer_config={"eos_token": "</s>"})))
    for enc in (byte_encoding(), bpe, sp):
        ids = enc.encode_ordinary_batch([TEXT])[0]
        decode = stream_decoder(enc)
        assert "".join(decode(token) for token in ids) + decode.flush() == TEXT == enc.decode(ids), enc.name
        # 🙂's four bytes are four tokens: the first three complete nothing, the fourth the whole character
        emoji = enc.encode_ordinary_batch(["a 🙂"])[0]
        decode = stream_decoder(enc)
        assert [decode(token) for token in emoji][-4:] == ["", "", "", "🙂"], enc.name
        # cut off inside a character: flush returns what is left as U+FFFD
        decode = stream_decoder(enc)
        text = "".join(decode(token) for token in emoji[:-1])
        assert text == "a " and set(decode.flush()) == {"\ufffd"} and decode.flush() == "", enc.name


def test_stream_decoder_continues_the_prompt_given_as_context(tmp_path):
    # SentencePiece-style: a token "▁world" reads " world" after other text but "world" at the start of a text
    sp = get_encoding(str(save(sentencepiece_bpe(), tmp_path / "sp", tokenizer_config={"eos_token": "</s>"})))
    ids = sp.encode("hello world, hello")
    for k in range(1, len(ids)):
        decode = stream_decoder(sp, context=ids[:k])
        continued = "".join(decode(token) for token in ids[k:]) + decode.flush()
        assert sp.decode(ids[:k]) + continued == sp.decode(ids), k


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
        batch = loader.next_batch()
        x, y = batch.x, batch.y
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
        starts = x[:, :1]
        assert torch.equal(x, starts + torch.arange(16)) and torch.equal(y, x + 1)  # a window; y shifted by one
        assert (starts >= 0).all() and (starts + 17 <= 1000).all()


def test_eval_batches_sequential_and_deterministic(tmp_path):
    data = fake_data(tmp_path, n_train=1000, n_val=50)
    loader = TokenLoader(data, block_size=8, batch_size=4, device="cpu", seed=0)
    batches = list(loader.eval_batches("val", 2))
    assert all(torch.equal(a.x, b.x) for a, b in zip(batches, loader.eval_batches("val", 2), strict=True))
    starts = torch.cat([b.x[:, 0] for b in batches]).tolist()
    assert starts == [0, 8, 16, 24, 32, 40 % 42, 48 % 42, 56 % 42]  # consecutive, wrapping over the 42 valid starts
    # two ranks split the same windows between them, every other one
    ranks = [TokenLoader(data, 8, 2, "cpu", 0, rank=r, world_size=2) for r in (0, 1)]
    x0, x1 = (next(r.eval_batches("val", 1)).x for r in ranks)
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
    for batch, again in zip(expected, (resumed.next_batch() for _ in range(2)), strict=True):
        assert torch.equal(batch.x, again.x) and torch.equal(batch.y, again.y)


def test_ranks_draw_different_batches(tmp_path):
    data = fake_data(tmp_path, n_train=5000, n_val=100)
    x0 = TokenLoader(data, 8, 4, "cpu", seed=0, rank=0, world_size=2).next_batch().x
    x1 = TokenLoader(data, 8, 4, "cpu", seed=0, rank=1, world_size=2).next_batch().x
    x0_again = TokenLoader(data, 8, 4, "cpu", seed=0, rank=0, world_size=2).next_batch().x
    assert not torch.equal(x0, x1) and torch.equal(x0, x0_again)
    # together they read the global batch of one rank with twice the batch size
    single = TokenLoader(data, 8, 8, "cpu", seed=0).next_batch().x
    assert torch.equal(torch.cat([x0, x1]), single)


@pytest.mark.gpu
def test_cuda_batches_match_cpu(tmp_path):
    data = fake_data(tmp_path, n_train=5000, n_val=100)
    cpu, cuda = (TokenLoader(data, 8, 4, device, seed=0) for device in ("cpu", "cuda"))
    batch, on_gpu = cpu.next_batch(), cuda.next_batch()
    assert on_gpu.x.is_cuda and torch.equal(batch.x, on_gpu.x.cpu()) and torch.equal(batch.y, on_gpu.y.cpu())


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


def test_a_directory_in_data_files_is_an_error_naming_it_and_a_glob_of_its_files(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    with pytest.raises(ValueError) as raised:
        prepare_dataset(text_config(tmp_path, PARAGRAPHS, data_files=["texts"]), root=tmp_path)
    assert str(raised.value) == (f"data.data_files: 'texts' names the directory {folder}: name the text files in it, "
                                 f"e.g. data.data_files=[{folder}/*.txt]")


def prepare_file(tmp_path: Path, content: bytes, name: str = "notes.txt") -> PreparedData:
    (tmp_path / name).write_bytes(content)
    return prepare_dataset(text_config(tmp_path, PARAGRAPHS, data_files=[name]), root=tmp_path)


def test_empty_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"notes\.txt is empty \(0 bytes\).*put text in it.*data\.data_files"):
        prepare_file(tmp_path, b"")


def test_empty_file_among_others_is_left_out(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    cfg = text_config(tmp_path, PARAGRAPHS, data_files=["empty.txt", "corpus.txt"])
    assert sorted(documents(prepare_dataset(cfg, root=tmp_path), byte_encoding())) == sorted(PARAGRAPHS)


def test_binary_file_is_an_error_naming_it_and_the_first_nul_byte(tmp_path):
    elf = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256))  # an executable's first bytes
    with pytest.raises(ValueError, match=r"notes\.txt: looks binary.*NUL byte at byte 7.*remove it from data\.data_"):
        prepare_file(tmp_path, elf)
    # a NUL byte early on makes a file binary even when a byte that is not UTF-8 comes first (a PNG)
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
    with pytest.raises(ValueError, match=r"looks binary.*NUL byte at byte 8"):
        prepare_file(tmp_path, png)


def test_utf16_file_is_an_error_with_the_iconv_command(tmp_path):
    with pytest.raises(ValueError, match=r"notes\.txt: UTF-16 text.*iconv -f utf-16 -t utf-8 .*notes\.txt > "
                                         r".*notes\.utf8\.txt"):
        prepare_file(tmp_path, "hello\n".encode("utf-16"))


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_non_utf8_file_names_the_exact_byte_the_bytes_and_the_iconv_fix(tmp_path, monkeypatch, chunk):
    # chunks of 1 and 3 bytes cut the two-byte "ü" and three-byte "✓" before the Latin-1 "é": the offset stays exact
    monkeypatch.setattr("data.prepare.CHECK_CHUNK", chunk)
    text = "über ✓\nline two: caf".encode() + "é au lait".encode("latin-1")
    offset = text.index(b"\xe9")
    with pytest.raises(ValueError, match=rf"notes\.txt: not UTF-8 at byte {offset} \(line 2\): b'\\xe9' in "
                                         r"b'.*caf\\xe9 au lait'.*iconv -f latin1 -t utf-8 .*notes\.txt > "
                                         r".*notes\.utf8\.txt, then use .*notes\.utf8\.txt in data\.data_files"):
        prepare_file(tmp_path, text)


def test_file_ending_inside_a_character_is_an_error_naming_the_byte(tmp_path):
    text = "cut off: ✓".encode()[:-1]  # the last character's first two of three bytes
    with pytest.raises(ValueError, match=rf"not UTF-8 at byte {len(text) - 2} .*unexpected end of data"):
        prepare_file(tmp_path, text)


def test_every_unreadable_file_is_named_at_once(tmp_path):
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")
    cfg = text_config(tmp_path, PARAGRAPHS, data_files=["latin.txt", "corpus.txt", "blob.bin"])
    with pytest.raises(ValueError) as err:
        prepare_dataset(cfg, root=tmp_path)
    assert "latin.txt: not UTF-8 at byte 3" in str(err.value) and "blob.bin: looks binary" in str(err.value)
    assert "corpus.txt" not in str(err.value)


def test_damaged_token_files(tmp_path):
    data = prepare_dataset(text_config(tmp_path, PARAGRAPHS), root=tmp_path)
    train, val = data.dir / "train.bin", data.dir / "val.bin"
    train.write_bytes(train.read_bytes()[:-2])
    with pytest.raises(ValueError, match=f"{train}.*delete the folder"):
        TokenLoader(data, block_size=4, batch_size=2, device="cpu", seed=0)
    val.unlink()
    with pytest.raises(ValueError, match=f"{val} is missing.*delete the folder"):
        data.tokens("val")


def test_tokenizer_paths_without_a_tokenizer_json_name_the_fix(tmp_path):
    fix = r"data\.encoding=bytes\|gpt2\|<path to tokenizer\.json or model dir>"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"neither a tiktoken encoding.*nor an existing file or folder.*{fix}"):
        get_encoding(str(tmp_path / "missing" / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"neither a tiktoken encoding.*{fix}"):
        get_encoding("gpt3")
    with pytest.raises(ValueError, match=f"holds no tokenizer.json.*{fix}.*save_pretrained"):
        get_encoding(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=f"holds no tokenizer.json.*{fix}"):  # before reading any text
        prepare_dataset(text_config(tmp_path, PARAGRAPHS, encoding=str(tmp_path / "empty")), root=tmp_path)
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match=f"not a Hugging Face tokenizer.json.*{fix}"):
        get_encoding(str(tmp_path / "broken.json"))


def test_tokenizer_json_without_an_end_of_text_token_names_the_fix(tmp_path):
    path = save(byte_level_bpe(special_tokens=("<pad>",)), tmp_path / "model")
    with pytest.raises(ValueError, match=r"cannot tell which token ends a document.*tokenizer_config\.json holding"):
        get_encoding(str(path))
    path = save(byte_level_bpe(), tmp_path / "named", tokenizer_config={"eos_token": "<|eot_id|>"})
    with pytest.raises(ValueError, match=r"eos_token '<\|eot_id\|>', which is not in the vocabulary.*set eos_token"):
        get_encoding(str(path))


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
