"""Generation (CPU): the KV cache gives the tokens of uncached generation and of transformers' generate, the cache's
block_size bound, sampling restrictions and seeds, sample.py streaming from our checkpoint and a GPT-2 dir, and
scripts/bench_generate.py."""

import codecs
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import table_rows
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sample
from data import get_encoding
from kernels import env
from model import GPT, GPTConfig
from model.generate import KVCache, LayerCache, sample_next, stream
from scripts import bench_generate
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import register_configs
from training.device import resolve_device
from training.loop import train

ROOT = Path(__file__).resolve().parents[1]
register_configs()

needs_triton = pytest.mark.skipif(  # these tests run the kernel on CPU tensors, through the Triton interpreter
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("attention", ["naive", "sdpa", pytest.param("triton", marks=needs_triton)])
def test_greedy_with_cache_equals_without_and_transformers(hf_gpt2_dir, attention):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).eval()
    model = GPT.from_pretrained(str(hf_gpt2_dir), attention=attention).eval()
    prompt = torch.randint(0, 257, (1, 7), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, 20, temperature=0.0)
    uncached = model.generate(prompt, 20, temperature=0.0, use_cache=False)
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(cached, uncached) and torch.equal(cached, expected), (cached, expected)
    assert len(set(cached[0, 7:].tolist())) > 3  # a real sequence, not one token repeated


def tiny_model(**kw) -> GPT:
    torch.manual_seed(0)
    config = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50, attention="sdpa")
    return GPT(GPTConfig(**{**config, **kw})).eval()


def wide_model(**kw) -> GPT:
    """A tiny model with large weights, whose greedy tokens vary (small ones repeat one token)."""
    model = tiny_model(**{"n_embd": 64, "vocab_size": 257, **kw})
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("heads", [dict(n_head=2), dict(n_head=4, n_kv_head=1)], ids=["mha", "mqa"])
def test_batched_cache_and_sliding_window_match_uncached(heads):
    model = tiny_model(**heads)
    prompt = torch.randint(0, 50, (3, 5))
    # 5 + 30 tokens: twice past block_size=16, where the window slides.
    assert torch.equal(model.generate(prompt, 30, temperature=0.0), model.generate(prompt, 30, 0.0, use_cache=False))
    long_prompt = torch.randint(0, 50, (1, 40))  # longer than block_size: both keep its last 16 tokens
    assert torch.equal(model.generate(long_prompt, 5, 0.0), model.generate(long_prompt, 5, 0.0, use_cache=False))
    torch.manual_seed(3)
    sampled = model.generate(prompt, 30, temperature=1.0, top_k=20)
    torch.manual_seed(3)
    assert torch.equal(sampled, model.generate(prompt, 30, temperature=1.0, top_k=20, use_cache=False))


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_stop_tokens_end_the_stream_once_every_row_has_one_with_the_tokens_of_a_run_without(use_cache):
    model = wide_model()
    prompt = torch.randint(0, 257, (3, 5), generator=torch.Generator().manual_seed(2))

    def run(**kw) -> torch.Tensor:
        return torch.cat(list(stream(model, prompt, 12, 0.0, use_cache=use_cache, lengths=[5, 3, 4], **kw)), dim=1)

    full = run()  # (3, 12)
    stop = {full[0, 2].item(), full[1, 6].item(), full[2, 4].item()}
    last = max(next(j for j, t in enumerate(row) if t in stop) for row in full.tolist())  # the last row to stop
    assert last < 11  # so the stream ends early
    assert torch.equal(run(stop_tokens=stop), full[:, : last + 1])
    unseen = next(t for t in range(257) if t not in full)
    assert torch.equal(run(stop_tokens=[unseen]), full)  # never produced: all max_new_tokens


@pytest.mark.parametrize("attention", ["naive", pytest.param("triton", marks=needs_triton)])
def test_grouped_query_model_generates_the_same_tokens_with_and_without_the_cache(attention):
    """The cache holds n_kv_head heads; decode steps attend to them with the query heads grouped."""
    model = wide_model(n_head=4, n_kv_head=2, attention=attention)
    prompt = torch.randint(0, 257, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model.config.n_layer, model.config.block_size)
    model.next_token_logits(prompt, cache)
    assert cache.layers[0].k.shape == (2, 2, 16, 16)  # (B, n_kv_head, block_size, head dim)
    cached = model.generate(prompt, 8, temperature=0.0)
    assert torch.equal(cached, model.generate(prompt, 8, temperature=0.0, use_cache=False))
    assert len(set(cached[0, 5:].tolist())) > 2


@needs_triton
def test_triton_model_with_a_head_dim_the_kernels_pad_generates_as_without_the_cache():
    """Head dim 24 (a multiple of 8 between the tile widths): training-shape attention runs padded in our kernel,
    decode steps in our decode kernel (a tile of 32, the channels past 24 masked)."""
    model = wide_model(n_embd=48, n_head=2, attention="triton", family="llama", n_kv_head=1)
    prompt = torch.randint(0, 257, (2, 5), generator=torch.Generator().manual_seed(2))
    cached = model.generate(prompt, 6, temperature=0.0)
    assert torch.equal(cached, model.generate(prompt, 6, temperature=0.0, use_cache=False))


def test_cache_is_bounded_by_block_size_and_prefill_checks_its_length(monkeypatch):
    model = tiny_model(block_size=8)
    cache = KVCache(n_layer=2, max_len=8)
    model.next_token_logits(torch.zeros(1, 8, dtype=torch.long), cache)
    assert cache.lengths.tolist() == [8] and cache.layers[0].k.shape == (1, 2, 8, 16)
    with pytest.raises(ValueError, match="sequence length 9 exceeds model.block_size=8"):
        model.next_token_logits(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length 6 exceeds the KV cache's max_len=5"):
        model.next_token_logits(torch.zeros(1, 6, dtype=torch.long), KVCache(n_layer=2, max_len=5))
    written = []  # positions the stream writes: never past the window
    original = LayerCache.append

    def spy(self: LayerCache, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        written.append(int(self.cache.positions.max()))
        return original(self, k, v)

    monkeypatch.setattr(LayerCache, "append", spy)
    list(stream(model, torch.zeros(1, 3, dtype=torch.long), 20, temperature=0.0))
    assert max(written) == 7
    buffers = []
    prefill = LayerCache.prefill

    def record(self: LayerCache, k: torch.Tensor, v: torch.Tensor) -> None:
        prefill(self, k, v)
        buffers.append(tuple(self.k.shape))

    monkeypatch.setattr(LayerCache, "prefill", record)
    list(stream(model, torch.zeros(1, 3, dtype=torch.long), 2, temperature=0.0))
    assert buffers[0] == (1, 2, 5, 16)  # prompt + new tokens, below block_size


@pytest.mark.parametrize("attention", ["naive", "sdpa", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("kind", [dict(n_head=2), dict(n_head=4, n_kv_head=2, family="llama", bias=False)],
                         ids=["gpt2", "llama-gqa"])
def test_prompts_of_different_lengths_in_one_batch_generate_what_each_generates_alone(attention, kind):
    """Right-padded prompts with per-row lengths: each row's greedy tokens are those of its prompt alone, with and
    without the cache, also past block_size=16 where each row's window slides on its own."""
    model = wide_model(attention=attention, **kind)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (3, 9, 6)]
    idx = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=7)  # (3, 9)
    lengths = [len(p) for p in prompts]
    for use_cache in (True, False):
        batch = torch.cat(list(stream(model, idx, 12, temperature=0.0, use_cache=use_cache, lengths=lengths)), 1)
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], 12, temperature=0.0, use_cache=False)[0, len(p):]
            assert torch.equal(batch[b], alone), (use_cache, b, batch[b], alone)
    assert len(set(batch[1].tolist())) > 3
    with pytest.raises(ValueError, match="lengths must give each of the 3 prompts a length in 1..9"):
        next(stream(model, idx, 1, lengths=[3, 10, 6]))


@pytest.mark.parametrize("attention", ["naive", "sdpa", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_attention_of_every_backend_matches_float64_masked_attention(attention, group):
    """One decode step of several tokens per row (Tq = 2) against static buffers whose slots past each row's
    position hold huge values (a stale or padded slot is finite; the cache starts zeroed): float64 attention to keys
    0..position of each query, per row."""
    from model.attention import DECODE_BACKENDS

    g = torch.Generator().manual_seed(group)
    B, nkv, S, hs, Tq = 3, 2, 37, 16, 2
    q = torch.randn(B, nkv * group, Tq, hs, generator=g)
    k, v = (torch.randn(B, nkv, S, hs, generator=g) for _ in range(2))
    positions = torch.tensor([[4, 5], [30, 31], [0, 1]])  # (B, Tq): row 2's first query sees one key
    for b in range(B):  # poison what no query may see
        k[b, :, positions[b, -1] + 1:] = 1e6
        v[b, :, positions[b, -1] + 1:] = 1e6
    y = DECODE_BACKENDS[attention](q, k, v, positions)
    assert y.shape == q.shape
    for b in range(B):
        for t in range(Tq):
            n = positions[b, t] + 1
            kk = k[b, :, :n].double().repeat_interleave(group, 0)  # (nh, n, hs)
            vv = v[b, :, :n].double().repeat_interleave(group, 0)
            att = (q[b, :, t].double()[:, None] @ kk.transpose(-2, -1) / hs**0.5).softmax(-1)  # (nh, 1, n)
            torch.testing.assert_close(y[b, :, t].double(), (att @ vv)[:, 0], atol=1e-5, rtol=1e-5)


def test_sampling_draws_each_token_with_its_probability():
    """argmax(p / Exponential(1)) is a draw from p: frequencies over 20,000 rows within 5 standard deviations."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.manual_seed(0)
    n = 20_000
    counts = torch.bincount(sample_next(p.log().expand(n, 4)).flatten(), minlength=4).double()
    sd = (n * p * (1 - p)).sqrt().double()
    assert ((counts - n * p.double()).abs() <= 5 * sd).all(), counts
    counts = torch.bincount(sample_next(p.log().expand(n, 4), temperature=2.0).flatten(), minlength=4).double()
    hot = p.sqrt() / p.sqrt().sum()  # temperature 2: p^(1/2), renormalised
    assert ((counts - n * hot.double()).abs() <= 5 * (n * hot * (1 - hot)).sqrt().double()).all(), counts


def test_sampling_restrictions_and_seeds():
    model = tiny_model()
    prompt = torch.randint(0, 50, (2, 4))
    assert torch.equal(model.generate(prompt, 10, top_k=1), model.generate(prompt, 10, temperature=0.0))
    torch.manual_seed(7)
    a = model.generate(prompt, 10)
    torch.manual_seed(7)
    assert torch.equal(a, model.generate(prompt, 10))

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)
    assert set(sample_next(logits, top_k=2).flatten().tolist()) == {0, 1}
    assert set(sample_next(logits, top_p=0.75).flatten().tolist()) == {0, 1}  # 0.5 < 0.75 <= 0.8
    assert set(sample_next(logits, top_p=0.5).flatten().tolist()) == {0}
    assert set(sample_next(logits, top_p=1.0).flatten().tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=0.0)


def test_sample_py_streams_transformers_greedy_tokens_from_a_gpt2_dir(hf_gpt2_dir, monkeypatch):
    from transformers import GPT2LMHeadModel

    produced: list[torch.Tensor] = []
    writes: list[tuple[int, str]] = []  # (tokens generated so far, text written)

    def counting_stream(*args, **kwargs):
        for token in stream(*args, **kwargs):
            produced.append(token)
            yield token

    class Recorder:
        def write(self, s: str) -> None:
            writes.append((len(produced), s))

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sample, "stream", counting_stream)
    monkeypatch.setattr(sys, "stdout", Recorder())
    sample.main(["--init-from", str(hf_gpt2_dir), "--prompt", "ab", "--encoding", "bytes", "--temperature", "0",
                 "--max-new-tokens", "12", "--device", "cpu", "--attention", "naive"])
    hf = GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).eval()
    ids = hf.generate(torch.tensor([[97, 98]]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    expected = codecs.decode(get_encoding("bytes").decode_bytes(ids), "utf-8", errors="replace")
    assert "".join(s for _, s in writes).rstrip("\n") == expected
    assert {n for n, _ in writes} >= set(range(1, 13))  # written token by token, not at the end


def test_sample_py_generates_several_prompts_in_one_batch_as_each_alone(hf_gpt2_dir, capsys, monkeypatch):
    batches = []  # the batch sizes stream is called with

    def recording_stream(model, idx, *args, **kwargs):
        batches.append(idx.size(0))
        return stream(model, idx, *args, **kwargs)

    monkeypatch.setattr(sample, "stream", recording_stream)
    common = ["--init-from", str(hf_gpt2_dir), "--encoding", "bytes", "--temperature", "0", "--max-new-tokens", "10",
              "--device", "cpu", "--attention", "naive"]
    sample.main([*common, "--prompt", "ab", "--prompt", "hello there", "--num-samples", "2"])
    together = capsys.readouterr().out
    alone = []
    for prompt in ("ab", "hello there"):
        sample.main([*common, "--prompt", prompt])
        alone.append(capsys.readouterr().out)
    assert batches == [4, 1, 1]
    assert together == ("\n" + "-" * 40 + "\n").join([alone[0], alone[0], alone[1], alone[1]])


@pytest.fixture(scope="module")
def our_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a 2-step training run: byte-level tokenizer, block_size 32, attention=sdpa."""
    root = tmp_path_factory.mktemp("our_run")
    tiny = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.batch_size=4",
            "train.max_steps=2", "data.max_documents=20", "train.eval_batches=2", "wandb.mode=disabled",
            f"data.cache_dir={root / 'cache'}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides=tiny))
    train(cfg, root / "run", root=root)
    return root / "run"


def changed_checkpoint(run: Path, out: Path, change: Callable[[dict], None]) -> Path:
    """A copy of the run's last checkpoint with change applied to its state, as if trained elsewhere."""
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    change(state)
    save_checkpoint(state, out)
    return out


def test_sample_py_samples_our_checkpoint_repeatably_with_a_seed(our_run):
    command = [sys.executable, "sample.py", "--init-from", str(our_run), "--prompt", "def ",
               "--max-new-tokens", "30", "--num-samples", "2", "--top-p", "0.9", "--seed", "1", "--device", "cpu"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("\n" + "-" * 40 + "\n")
    assert first.startswith("def ") and second.startswith("def ")
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.stdout == result.stdout  # --seed makes it repeatable


def test_sample_py_lets_sdpa_choose_its_kernel_for_a_checkpoint_that_pinned_one(our_run, tmp_path, capsys):
    """Trained with attention.sdpa_backend=cudnn (on a GPU), sampled where cuDNN attention cannot run (CPU)."""
    pinned = changed_checkpoint(our_run, tmp_path / "pinned.pt",
                                lambda state: state["model_config"].update(attention="sdpa", sdpa_backend="cudnn"))
    sample.main(["--init-from", str(pinned), "--prompt", "def ", "--max-new-tokens", "5", "--device", "cpu"])
    assert capsys.readouterr().out.startswith("def ")


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """sample.py's message for argv, which must be argparse's usage error: exit status 2, the usage line first, and
    words for sample.py's flags, not train.py's config keys."""
    with pytest.raises(SystemExit) as exited:
        sample.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: sample.py" in err, err  # after whatever loading the model printed
    message = err.split("sample.py: error: ", 1)[1]
    assert "train." not in message and "model." not in message and "init_from" not in message, message
    return message


BAD_ARGUMENTS = [  # (arguments, the start of sample.py's message)
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "-3"], "argument --max-new-tokens: must be >= 1, got -3"),
    (["--num-samples", "0"], "argument --num-samples: must be >= 1, got 0"),
    (["--num-samples", "-1"], "argument --num-samples: must be >= 1, got -1"),
    (["--temperature", "-0.5"], "argument --temperature: must be a finite number >= 0 (0: greedy), got -0.5"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0 (0: greedy), got inf"),
    (["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    (["--prompt-file", "no-such-prompt.txt"], "argument --prompt-file: no such file: no-such-prompt.txt"),
    (["--prompt-file", str(ROOT / "docs")], f"argument --prompt-file: {ROOT / 'docs'} is a directory: name a text "
                                            "file"),
    (["--encoding", __file__], f"the tokenizer {__file__!r} does not load: {__file__} is not a Hugging Face "
                               "tokenizer.json"),
    (["--encoding", "no-such-tokenizer"], "argument --encoding: 'no-such-tokenizer' is no tokenizer here: use bytes"),
    (["--init-from", "no/such/run"], "argument --init-from: 'no/such/run' is no file or directory here, nor a GPT-2 "
                                     "name"),
]


@pytest.mark.parametrize("args, expected", BAD_ARGUMENTS, ids=[" ".join(args) for args, _ in BAD_ARGUMENTS])
def test_sample_py_bad_argument_is_a_usage_error_naming_its_flag(hf_gpt2_dir, capsys, args, expected):
    message = usage_error(["--init-from", str(hf_gpt2_dir), "--encoding", "bytes", "--device", "cpu", *args], capsys)
    assert message.startswith(expected), message


def test_sample_py_cuda_without_a_gpu_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = usage_error(["--init-from", "gpt2", "--device", "cuda"], capsys)  # refused before gpt2 is fetched
    assert message == "--device=cuda but no CUDA GPU is visible: use --device=auto or --device=cpu\n"


def test_cuda_without_a_gpu_is_one_error_line_in_train_py_too(monkeypatch, capsys):
    from training.launch import report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as raised:
        resolve_device("cuda", key="train.device")
    report(raised.value)
    assert capsys.readouterr().err == ("error: train.device=cuda but no CUDA GPU is visible: use train.device=auto or "
                                       "train.device=cpu\n")


def test_sample_py_triton_off_a_gpu_is_a_usage_error_naming_attention(hf_gpt2_dir, our_run, tmp_path, monkeypatch,
                                                                      capsys):
    """Without TRITON_INTERPRET=1 our kernels refuse CPU tensors: asked for (--attention) or the checkpoint's."""
    monkeypatch.setattr(env, "INTERPRET", False)
    message = usage_error(["--init-from", str(hf_gpt2_dir), "--device", "cpu", "--attention", "triton"], capsys)
    assert message.startswith("argument --attention: triton runs our kernels on a CUDA GPU, not on cpu (there only "
                              "under TRITON_INTERPRET=1, slowly): use --attention sdpa"), message
    trained = changed_checkpoint(our_run, tmp_path / "triton.pt",
                                 lambda state: state["model_config"].update(attention="triton"))
    message = usage_error(["--init-from", str(trained), "--device", "cpu"], capsys)
    assert message.startswith("argument --attention: the checkpoint's backend, triton, runs our kernels on a CUDA "
                              "GPU"), message


@pytest.mark.parametrize("kind", ["empty", "truncated", "state-dict", "run-dir"])
def test_sample_py_unreadable_checkpoint_or_run_dir_is_a_usage_error_saying_why(our_run, tmp_path, capsys, kind):
    path = tmp_path / ("run" if kind == "run-dir" else "x.pt")
    if kind == "run-dir":  # started, stopped before its first checkpoint
        (path / ".hydra").mkdir(parents=True)
    elif kind == "state-dict":
        torch.save(load_checkpoint(our_run / "checkpoints" / "last.pt")["model"], path)
    else:
        data = (our_run / "checkpoints" / "last.pt").read_bytes()
        path.write_bytes(b"" if kind == "empty" else data[: len(data) // 2])
    corrupt = f"{path} is corrupt or not a checkpoint"
    expected = {"empty": corrupt, "truncated": corrupt,
                "state-dict": f"{path} is not a flashgpt-checkpoint-v1 checkpoint of this project",
                "run-dir": f"{path} is a run directory without checkpoints (no checkpoints/best or last .pt or .dcp)"}
    message = usage_error(["--init-from", str(path), "--device", "cpu"], capsys)
    assert message.startswith(f"argument --init-from: {expected[kind]}"), message


def test_sample_py_prompt_beyond_the_vocabulary_is_a_usage_error_naming_encoding(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100, n_positions=16, bos_token_id=None,
                        eos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    message = usage_error(["--init-from", str(tmp_path), "--encoding", "bytes", "--device", "cpu", "--prompt", "~"],
                          capsys)  # "~" is byte 126
    assert message.startswith("the prompt's token ids reach 126, beyond the model's vocabulary of 100: pick the "
                              "tokenizer it was trained with (--encoding)"), message


def test_sample_py_checkpoint_whose_tokenizer_is_not_here_is_a_usage_error_naming_encoding(our_run, tmp_path, capsys):
    """A run fine-tuned from a hub model recorded its tokenizer's folder in that machine's Hugging Face cache."""
    gone = str(tmp_path / "gone")
    elsewhere = changed_checkpoint(our_run, tmp_path / "elsewhere.pt",
                                   lambda state: state["config"]["data"].update(encoding=gone))
    message = usage_error(["--init-from", str(elsewhere), "--device", "cpu"], capsys)
    assert message.startswith(f"the model's tokenizer {gone!r} is not on this machine: pass --encoding (bytes, a "
                              "tiktoken encoding"), message


def test_bench_generate_measures_ours_and_transformers_with_equal_greedy_tokens(tmp_path):
    results = bench_generate.main(["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--prompt-len", "16",
                                   "--new-tokens", "4", "--batch-sizes", "1,2", "--repeats", "1", "--attention",
                                   "naive,sdpa", "--methods", "eager,no-cache,hf-static,hf-dynamic",
                                   "--out", str(tmp_path)])
    methods = ["naive-eager", "sdpa-eager", "naive-no-cache", "sdpa-no-cache", "hf-static", "hf-dynamic"]
    assert [(c["batch_size"], c["method"]) for c in results["cells"]] == [(b, m) for b in (1, 2) for m in methods]
    assert all(c["tokens_per_sec"] > 0 and c["ttft_s"] > 0 and c["matches_hf_static"] == 4 for c in results["cells"])
    assert results["cells"][4]["vs_hf_static"] == 1.0
    assert json.loads((tmp_path / "results.json").read_text()) == results
    rows = table_rows((tmp_path / "results.md").read_text())
    assert [(r["batch"], r["method"], r["tokens = hf-static's"]) for r in rows] == [
        (str(b), m, "4") for b in (1, 2) for m in methods]

@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_cuda_graph_and_compiled_decode_give_the_tokens_of_eager_decode(attention):
    """Greedy tokens of a ragged GQA batch through the window slide (prompts up to 9 + 12 tokens > block_size 16:
    prefills between graph replays), eager vs CUDA graph vs torch.compile + CUDA graph; and seeded sampling in the
    graph repeats."""
    model = wide_model(attention=attention, family="llama", n_head=4, n_kv_head=2, bias=False).cuda()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (3, 9, 6)]
    idx = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).cuda()
    lengths = [len(p) for p in prompts]

    def run(**kw) -> torch.Tensor:
        return torch.cat(list(stream(model, idx, 12, lengths=lengths, **kw)), 1)

    eager = run(temperature=0.0, cuda_graph=False)
    assert torch.equal(run(temperature=0.0), eager)
    assert torch.equal(run(temperature=0.0, compile=True), eager)
    assert torch.equal(run(temperature=0.0, use_cache=False), eager)
    torch.manual_seed(5)
    sampled = run(temperature=1.0, top_p=0.9)
    torch.manual_seed(5)
    assert torch.equal(run(temperature=1.0, top_p=0.9), sampled)
