"""The Llama family (CPU, no network) against transformers: random-weight Llama (GQA, tied head), Llama with Llama-3
rope scaling, and Qwen2 (q/k/v biases, untied head) saved with save_pretrained. Logits to 1e-4 in fp32 and greedy
generation equal on every attention backend, export back to transformers, sharded checkpoints, unsupported configs,
the model presets' published shapes."""

import json
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model import GPT, GPTConfig
from model.pretrained import PretrainedError
from model.rope import inverse_frequencies, rope_cos_sin
from training.config import register_configs
from training.init import resolve_init

ROOT = Path(__file__).resolve().parents[1]
register_configs()
VOCAB = 300

needs_triton = pytest.mark.skipif(  # these tests run the kernel on CPU tensors, through the Triton interpreter
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1",
)
BACKENDS = ["naive", "sdpa", pytest.param("triton", marks=needs_triton)]


KINDS = ["llama-gqa-tied", "llama3-rope-mqa", "qwen2-bias-untied"]


def hf_model(kind: str, vocab_size: int = VOCAB) -> torch.nn.Module:
    """A random transformers model; weights drawn wider than the usual init so greedy decoding varies."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shapes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=vocab_size, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if kind == "llama-gqa-tied":
        model = LlamaForCausalLM(LlamaConfig(**shapes, num_key_value_heads=2, tie_word_embeddings=True,
                                             rms_norm_eps=1e-5))
    elif kind == "llama3-rope-mqa":  # original context 16: every regime of the scaling (kept, smoothed, divided)
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=16)
        model = LlamaForCausalLM(LlamaConfig(**shapes, num_key_value_heads=1, rope_theta=500000.0,
                                             rope_scaling=scaling, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shapes, num_key_value_heads=2, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module", params=KINDS)
def hf_dir(request, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(path)
    return path


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("attention", BACKENDS)
def test_logits_match_transformers(hf_dir, attention):
    model = GPT.from_pretrained(str(hf_dir), attention=attention).eval()
    idx = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))  # odd T
    with torch.no_grad():
        ours, theirs = model(idx)[0], load_hf(hf_dir)(idx).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", BACKENDS)
def test_greedy_generation_equals_transformers_with_and_without_the_cache(hf_dir, attention):
    model = GPT.from_pretrained(str(hf_dir), attention=attention).eval()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    theirs = load_hf(hf_dir).generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=mask)
    assert torch.equal(model.generate(prompt, 12, temperature=0.0), theirs)
    assert torch.equal(model.generate(prompt, 12, temperature=0.0, use_cache=False), theirs)


def test_export_loads_in_transformers_with_equal_logits_and_reloads_here(hf_dir, tmp_path):
    model = GPT.from_pretrained(str(hf_dir)).eval()
    model.save_pretrained(str(tmp_path))
    idx = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        ours, exported = model(idx)[0], load_hf(tmp_path)(idx).logits
        again = GPT.from_pretrained(str(tmp_path)).eval()(idx)[0]
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == \
        json.loads((tmp_path / "config.json").read_text())["model_type"]
    torch.testing.assert_close(exported, ours, atol=1e-4, rtol=0)
    assert torch.equal(again, ours)


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    hf = hf_model("llama-gqa-tied")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    idx = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_pretrained(str(tmp_path)).eval()(idx)[0], hf(idx).logits, atol=1e-4, rtol=0)


def test_llama3_frequencies_equal_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(64, 500000.0, scaling, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert (ours < inverse_frequencies(64, 500000.0, None, torch.device("cpu"))).any()  # the scaling did something


def test_rope_tables_are_the_float64_angles_and_have_meta_shapes():
    """The rotary tables (an opaque op for torch.compile) equal the float64 cos/sin of position · inv_freq, for rows
    with their own positions; on meta tensors (tracing) they have the real shapes and fp32."""
    positions = torch.tensor([[0, 1, 2, 7], [5, 6, 9, 2047]])  # (B, T): each row its own positions
    cos, sin = rope_cos_sin(positions, 64, 500000.0, None, torch.device("cpu"))
    # the angle is an fp32 product (as Hugging Face's), its cos and sin taken in float64
    angles = (positions.float()[..., None] * inverse_frequencies(64, 500000.0, None, torch.device("cpu"))).double()
    angles = torch.cat((angles, angles), dim=-1)  # (B, T, 64)
    torch.testing.assert_close(cos.double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), angles.sin(), rtol=0, atol=1e-6)
    meta = rope_cos_sin(positions.to("meta"), 64, 500000.0, None, torch.device("meta"))
    assert [(t.shape, t.dtype) for t in meta] == [((2, 4, 64), torch.float32)] * 2


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type 'yarn'"),
    ({"head_dim": 32}, "head_dim=32"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
])
def test_unsupported_llama_configs_are_named(tmp_path, change, message):
    torch.manual_seed(0)
    hf_model("llama-gqa-tied").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(PretrainedError, match=message):
        GPT.from_pretrained(str(tmp_path))


def test_llama_export_refuses_what_transformers_cannot_express(tmp_path):
    model = GPT(GPTConfig(family="llama", n_layer=1, n_head=2, n_embd=16, vocab_size=50, bias=True, qkv_bias=False))
    with pytest.raises(PretrainedError, match="qkv_bias == bias"):
        model.save_pretrained(str(tmp_path))


def test_gpt2_export_round_trip_drops_the_padded_vocabulary(tmp_path):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=100, bias=False)).eval()
    model.save_pretrained(str(tmp_path))
    idx = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        theirs = GPT2LMHeadModel.from_pretrained(tmp_path).eval()(idx).logits
        torch.testing.assert_close(theirs, model(idx)[0], atol=1e-4, rtol=0)


# Published shapes: (parameters, vocabulary) of each preset, from the models' config.json files.
PRESETS = {"smollm2-135m": (134_515_008, 49152), "smollm2-360m": (361_821_120, 49152),
           "qwen2.5-0.5b": (494_032_768, 151936), "llama-3.2-1b": (1_235_814_400, 128256),
           "tinyllama-1.1b": (1_100_048_384, 32000)}


@pytest.mark.parametrize("preset", PRESETS)
def test_model_presets_have_the_published_parameter_counts(preset):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides=[f"model={preset}"]))
    config = resolve_init(cfg).gpt_config
    with torch.device("meta"):
        model = GPT(config)
    assert (sum(p.numel() for p in model.parameters()), config.vocab_size) == PRESETS[preset]


# --- fine-tuning a Hugging Face Llama dir through train.py, with the model's own tokenizer --------------------------
LINES = [f"The {c} cat sat on the {m} mat and looked at the {c} dog number {i}." for i in range(120)
         for c, m in [("black", "red"), ("white", "green")]]


@pytest.fixture(scope="module", params=KINDS)
def llama_dir_with_tokenizer(request, tmp_path_factory) -> Path:
    """A random transformers model of each kind whose vocabulary is that of a byte-level BPE tokenizer.json trained
    here, with <|endoftext|> as its end-of-text token: what a SmolLM2 download looks like, in miniature."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp(request.param)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(LINES, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    hf_model(request.param, vocab_size=tokenizer.get_vocab_size()).save_pretrained(path)
    return path


def finetune_overrides(tmp_path: Path, model_dir: Path, *more: str) -> list[str]:
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(LINES))
    return ["+experiment=finetune_llama", f"init_from={model_dir}", f"data.data_files=[{text}]",
            f"data.cache_dir={tmp_path / 'cache'}", "model.block_size=32", "train.batch_size=4",
            "train.grad_accum_steps=1", "train.eval_batches=2", "train.warmup_steps=2", "train.learning_rate=3e-3",
            "train.perf_warmup_steps=2", "train.log_interval=1", "wandb.mode=disabled", "train.device=cpu", *more]


@needs_triton
def test_train_py_fine_tunes_a_llama_dir_on_its_own_tokenizer_with_triton(llama_dir_with_tokenizer, tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    overrides = finetune_overrides(tmp_path, llama_dir_with_tokenizer, "attention=triton", "train.max_steps=4",
                                   "train.eval_interval=4", f"hydra.run.dir={run}")
    result = subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert config.data.encoding is None  # the preset's null ...
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(m["step"] for m in metrics if "train/loss" in m) == [1, 2, 3, 4]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert state["config"]["data"]["encoding"] == str(llama_dir_with_tokenizer.resolve())  # ... is the model's
    assert state["model_config"]["family"] == "llama" and state["model_config"]["n_kv_head"] in (1, 2)
    assert state["model_config"]["dropout"] == 0.1 and state["model_config"]["attention"] == "triton"


def test_fine_tuning_a_llama_dir_resumes_exactly(llama_dir_with_tokenizer, tmp_path):
    from training.loop import train

    def losses(name: str, *more: str) -> dict[int, float]:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            cfg = OmegaConf.to_object(compose("config", overrides=finetune_overrides(
                tmp_path, llama_dir_with_tokenizer, "train.eval_interval=3", "train.lr_decay_steps=6", *more)))
        train(cfg, tmp_path / name, root=tmp_path)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {m["step"]: m["train/loss"] for m in map(json.loads, lines) if "train/loss" in m}

    full = losses("full", "train.max_steps=6")
    losses("first", "train.max_steps=3")
    resumed = losses("second", "train.max_steps=6", f"train.resume={tmp_path / 'first'}")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == full[s] for s in resumed), (resumed, full)
    assert full[6] < full[1]


def test_sample_py_streams_transformers_greedy_text_from_a_llama_dir(llama_dir_with_tokenizer, capsys):
    import sample
    from data import get_encoding

    enc = get_encoding(str(llama_dir_with_tokenizer))
    prompt = "The black cat"
    ids = torch.tensor([enc.encode(prompt)])
    theirs = load_hf(llama_dir_with_tokenizer).generate(ids, max_new_tokens=10, do_sample=False,
                                                         attention_mask=torch.ones_like(ids), eos_token_id=None)
    sample.main(["--init-from", str(llama_dir_with_tokenizer), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "10", "--device", "cpu", "--dtype", "fp32"])
    assert capsys.readouterr().out == enc.decode(theirs[0].tolist()) + "\n"
