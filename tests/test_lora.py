"""LoRA (model/lora.py) on CPU against peft: step 0 is the base model, our adapters compute what peft's LoRA computes
on the same transformers model with the same A and B (Llama with GQA and Qwen2, each target set), PEFT's adapter
directory in and out, merging, gradients on the adapters only; a LoRA run out (sample.py, scripts/export_hf.py merged
and --adapter, against transformers and peft) and an adapter directory in (sample.py --adapter, init_from)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT, make_cfg, train_losses

import sample
from model import GPT, GPTConfig
from model.config import LoRAConfig
from model.generate import stream
from model.lora import LoRAError, LoRALinear, add_lora, load_adapter, merge_lora, save_adapter
from scripts import export_hf
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.config import validate
from training.init import checkpoint_model, resolve_init
from training.loop import train

TARGET_SETS = [["q", "v"], ["all"], ["k", "o", "up"]]


def hf_model(kind: str) -> torch.nn.Module:
    """A random transformers Llama (GQA) or Qwen2 (q/k/v biases), weights wider than the usual init."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shapes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=64, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    model = (LlamaForCausalLM(LlamaConfig(**shapes, tie_word_embeddings=True)) if kind == "llama" else
             Qwen2ForCausalLM(Qwen2Config(**shapes, tie_word_embeddings=False)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_dir(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(path)
    return path


def ours(hf_dir: Path) -> GPT:
    return GPT.from_pretrained(str(hf_dir), attention="naive").eval()


def randomize_adapters(model: torch.nn.Module) -> None:
    """Non-zero B (and fresh A) everywhere: a trained adapter's effect, not step 0's zero."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)


def test_step_0_equals_the_base_model_and_only_the_adapters_train(hf_dir):
    model, base = ours(hf_dir), ours(hf_dir)
    add_lora(model, LoRAConfig(rank=4, alpha=8, targets=["all"]))
    idx = torch.randint(0, 300, (2, 17))
    assert torch.equal(model(idx)[0], base(idx)[0])  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        _, loss = model.train()(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert not torch.equal(model.eval()(idx)[0], base(idx)[0])  # the adapters moved


@pytest.mark.parametrize("targets", TARGET_SETS)
def test_our_adapters_compute_peft_lora_and_round_trip_peft_directories(hf_dir, targets, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = ours(hf_dir)
    add_lora(model, LoRAConfig(rank=4, alpha=12, targets=targets))
    randomize_adapters(model)
    idx = torch.randint(0, 300, (2, 11))
    expected = model(idx)[0]

    # ours -> PEFT: peft.PeftModel loads our adapter directory and computes our logits
    save_adapter(model, tmp_path / "ours", base=str(hf_dir))
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), tmp_path / "ours").eval()
    torch.testing.assert_close(peft_model(idx).logits, expected, atol=1e-5, rtol=0)

    # PEFT -> ours: an adapter peft made (its own init, B made non-zero) loads here with peft's logits
    modules = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
               "down": "down_proj"}
    chosen = list(modules.values()) if targets == ["all"] else [modules[t] for t in targets]
    made = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir),
                          LoraConfig(r=3, lora_alpha=5, target_modules=chosen, lora_dropout=0.0))
    randomize_adapters(made)
    made.save_pretrained(tmp_path / "peft")
    loaded = ours(hf_dir)
    load_adapter(loaded, tmp_path / "peft")
    torch.testing.assert_close(loaded(idx)[0], made.eval()(idx).logits, atol=1e-5, rtol=0)

    # merged: plain Linear layers again, the same logits
    merge_lora(loaded)
    assert not any(isinstance(m, LoRALinear) for m in loaded.modules())
    torch.testing.assert_close(loaded(idx)[0], made(idx).logits, atol=1e-5, rtol=0)


def lora_linear_and_formula(dtype: torch.dtype, in_features: int = 24, dropout: float = 0.0
                             ) -> tuple[LoRALinear, callable]:
    """A LoRALinear over three row blocks (q and v adapted, the middle one not; out = 15) and its formula spelled
    out: y = W x + b + 3 · B A xd, xd the adapters' input (x, or its dropout)."""
    torch.manual_seed(0)
    m = LoRALinear(torch.nn.Linear(in_features, 15, dtype=dtype), [("q", 5), (None, 7), ("v", 3)],
                   LoRAConfig(rank=2, alpha=6, dropout=dropout)).to(dtype)
    m.requires_grad_(False)
    randomize_adapters(m)
    for p in (*m.lora_A.values(), *m.lora_B.values()):
        p.requires_grad_(True)

    def formula(x, w, bias, a, b, xd=None):
        xd = x if xd is None else xd
        delta = [3.0 * xd @ a[t].T @ b[t].T for t in ("q", "v")]
        return x @ w.T + bias + torch.cat([delta[0], x.new_zeros(*x.shape[:-1], 7), delta[1]], -1)

    return m, formula


# in > out (the down projection's shape) and in <= out (q/k/v, gate/up) take different matmul orders
@pytest.mark.parametrize("in_features", [24, 6])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_lora_linear_output_and_adapter_gradients_equal_the_float64_formula(in_features, dropout):
    m, formula = lora_linear_and_formula(torch.float64, in_features, dropout)
    x = torch.randn(7, in_features, 3, dtype=torch.float64).transpose(1, 2).requires_grad_(True)  # strided
    dy = torch.randn(7, 3, 15, dtype=torch.float64)
    leaves = [x, *m.lora_A.values(), *m.lora_B.values()]
    torch.manual_seed(1)
    out = m(x)
    got = torch.autograd.grad(out, leaves, dy)
    torch.manual_seed(1)  # the same dropout mask
    xd = torch.nn.functional.dropout(x, dropout) if dropout else None
    assert xd is None or (xd == 0).any()
    y = formula(x, m.weight, m.bias, dict(m.lora_A), dict(m.lora_B), xd)
    torch.testing.assert_close(out, y, atol=1e-12, rtol=0)
    for g, want in zip(got, torch.autograd.grad(y, leaves, dy), strict=True):
        torch.testing.assert_close(g, want, atol=1e-12, rtol=0)
    assert m.weight.grad is None and m.bias.grad is None  # the base stays frozen
    m.weight.requires_grad_(True)  # its gradient would be dropped: refused
    with pytest.raises(LoRAError, match="base weight requires grad"):
        m(x)


@pytest.mark.parametrize("in_features", [24, 6])
def test_lora_linear_under_bf16_autocast_errs_at_most_twice_the_plain_bf16_formula(in_features):
    m, formula = lora_linear_and_formula(torch.float32, in_features)
    m.weight.data, m.bias.data = m.weight.bfloat16(), m.bias.bfloat16()  # the frozen base in bf16, as trained
    x = torch.randn(4, 9, in_features)
    dy = torch.randn(4, 9, 15)
    leaves = [*m.lora_A.values(), *m.lora_B.values()]

    def outputs(f) -> list[torch.Tensor]:
        xs = x.clone().requires_grad_(True)
        y = f(xs)
        return [y.double(), *(g.double() for g in torch.autograd.grad(y, [xs, *leaves], dy))]

    exact = outputs(lambda xs: formula(xs.double(), m.weight.double(), m.bias.double(),
                                       {t: a.double() for t, a in m.lora_A.items()},
                                       {t: b.double() for t, b in m.lora_B.items()}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours_ = outputs(m)
        plain = outputs(lambda xs: formula(xs, m.weight, m.bias, dict(m.lora_A), dict(m.lora_B)))
    for o, p, e in zip(ours_, plain, exact, strict=True):
        assert (o - e).abs().max() <= 2 * (p - e).abs().max() + 1e-3


def test_compiled_lora_keeps_no_copy_of_the_base_weights_for_the_backward():
    """The one-matmul [W | B] of each adapted layer is rebuilt in the backward, not kept from the forward: a compiled
    graph must not hold a weight-sized copy per layer (or a [x | z] copy of its input) from forward to backward."""
    model = GPT(GPTConfig(family="llama", n_layer=1, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96,
                          vocab_size=300, block_size=16, bias=False)).to(torch.bfloat16)
    add_lora(model, LoRAConfig(rank=4, alpha=8, targets=["all"]))
    widths = {m.in_features + 4 * len(m.adapted) for m in model.modules() if isinstance(m, LoRALinear)}
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    idx = torch.randint(0, 300, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = torch.compile(model.train())(idx, idx)
    loss.backward()
    assert shapes and not [s for s in shapes if s and s[-1] in widths], shapes


def test_bad_targets_and_foreign_adapters_are_named(hf_dir, tmp_path):
    with pytest.raises(LoRAError, match="lora.targets: qkv is no linear layer of a llama model"):
        add_lora(ours(hf_dir), LoRAConfig(rank=4, targets=["qkv"]))
    with pytest.raises(ValueError, match="lora.rank must be >= 0"):
        LoRAConfig(rank=-1)
    model = ours(hf_dir)
    add_lora(model, LoRAConfig(rank=2, targets=["q"]))
    save_adapter(model, tmp_path / "a")
    with pytest.raises(LoRAError, match="has adapters already"):
        load_adapter(model, tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 4, '
                                                        '"use_dora": true}')
    with pytest.raises(LoRAError, match="use_dora=True is not supported"):
        load_adapter(ours(hf_dir), tmp_path / "a")
    with pytest.raises(LoRAError, match="is no adapter directory"):
        load_adapter(ours(hf_dir), tmp_path)


def lora_run(tmp_path: Path, hf_dir: Path, name: str, *overrides: str) -> dict:
    cfg = make_cfg(tmp_path, f"init_from={hf_dir}", "data.encoding=bytes", "lora.rank=4", "lora.alpha=8",
                   "train.dtype=fp32", "train.log_interval=1", "train.eval_interval=2", "train.lr_decay_steps=4",
                   "train.learning_rate=1e-2", "wandb.mode=disabled", *overrides)
    return train(cfg, tmp_path / name, root=tmp_path)


@pytest.mark.parametrize("hf_dir", ["llama"], indirect=True)
def test_a_lora_run_checkpoints_the_adapters_alone_resumes_exactly_and_only_on_its_base(hf_dir, tmp_path):
    summary = lora_run(tmp_path, hf_dir, "full", "train.max_steps=4")
    state = load_checkpoint(tmp_path / "full")
    assert state["model"] and all(".lora_" in k for k in state["model"])  # the base is not in it
    assert state["lora"]["rank"] == 4 and state["base"]["init_from"] == str(hf_dir)
    assert summary["n_trainable_params"] == sum(t.numel() for t in state["model"].values())

    # The base came through training bit for bit; the adapters load onto it, merged or not, with the same logits.
    model, base = checkpoint_model(tmp_path / "full"), ours(hf_dir)
    frozen = dict(base.named_parameters())
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    idx = torch.randint(0, 257, (2, 9))
    merged = checkpoint_model(tmp_path / "full", merge=True)
    torch.testing.assert_close(merged.eval()(idx)[0], model.eval()(idx)[0], atol=1e-5, rtol=0)

    # 2 + 2 steps give the losses of 4
    lora_run(tmp_path, hf_dir, "half", "train.max_steps=2")
    lora_run(tmp_path, hf_dir, "resumed", "train.max_steps=4", f"train.resume={tmp_path / 'half'}")
    full, resumed = train_losses(tmp_path / "full"), train_losses(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == full[s] for s in resumed)

    # Another base of the same shapes is refused; so is a resume that changes the adapters
    other = tmp_path / "other-base"
    changed = hf_model("llama")
    with torch.no_grad():
        next(changed.parameters()).add_(1.0)
    changed.save_pretrained(other)
    with pytest.raises(CheckpointError, match="its adapters were trained on init_from="):
        train(make_cfg(tmp_path, f"init_from={other}", "data.encoding=bytes", "lora.rank=4", "lora.alpha=8",
                       "train.max_steps=4", f"train.resume={tmp_path / 'half'}"), tmp_path / "x", root=tmp_path)
    with pytest.raises(CheckpointError, match="lora.rank: checkpoint 4 vs run 8"):
        lora_run(tmp_path, hf_dir, "y", "train.max_steps=4", "lora.rank=8", f"train.resume={tmp_path / 'half'}")


def test_lora_needs_a_pretrained_init_from(tmp_path):
    with pytest.raises(ValueError, match="lora.rank=4 trains adapters on a pretrained model"):
        validate(make_cfg(tmp_path, "lora.rank=4"))


# --- out and in: sample.py, scripts/export_hf.py and init_from=<adapter dir> on a LoRA run ---


@pytest.fixture(scope="module")
def lora_out(tmp_path_factory) -> dict[str, Path]:
    """A 2-step LoRA run (rank 4, every target) on a random Llama of the byte vocabulary (257 ids: every greedy token
    prints), its base, its last checkpoint and its two exports: merged (a Hugging Face dir) and --adapter (PEFT's)."""
    tmp = tmp_path_factory.mktemp("lora_out")
    base = hf_model("llama")
    base.resize_token_embeddings(257)
    base.save_pretrained(tmp / "base")
    lora_run(tmp, tmp / "base", "run", "train.max_steps=2")
    for name, flags in (("merged", []), ("adapter", ["--adapter"])):
        export_hf.main([str(tmp / "run"), str(tmp / name), "--checkpoint", "last", *flags])
    return {"last": tmp / "run" / "checkpoints" / "last.pt", **{n: tmp / n for n in ("base", "merged", "adapter")}}


def test_export_hf_writes_a_lora_run_merged_for_transformers_and_as_a_peft_adapter_both_with_our_logits(lora_out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    idx = torch.randint(0, 257, (2, 13))
    expected = checkpoint_model(lora_out["last"]).eval()(idx)[0]
    assert (expected - ours(lora_out["base"])(idx)[0]).abs().max() > 1e-3  # the adapters trained
    assert sorted(p.name for p in lora_out["merged"].iterdir()) == ["config.json", "model.safetensors",
                                                                    "tokenizer.json", "tokenizer_config.json"]
    merged = AutoModelForCausalLM.from_pretrained(lora_out["merged"]).eval()
    torch.testing.assert_close(merged(idx).logits, expected, atol=1e-5, rtol=0)

    adapter = lora_out["adapter"]
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                         "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(lora_out["base"])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora_out["base"]), adapter).eval()
    torch.testing.assert_close(peft_model(idx).logits, expected, atol=1e-5, rtol=0)


def test_sample_py_gives_peft_greedy_tokens_for_a_lora_run_merged_or_not_and_for_its_adapter_dir(lora_out,
                                                                                                 monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    produced: list[list[int]] = []  # the tokens of each sample.main call

    def recording_stream(*args, **kwargs):
        produced.append([])
        for token in stream(*args, **kwargs):
            produced[-1].append(token.item())
            yield token

    monkeypatch.setattr(sample, "stream", recording_stream)
    run, adapter, base = (str(lora_out[name]) for name in ("last", "adapter", "base"))
    greedy = ["--prompt", "ab", "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    for init in ([run], [run, "--merge"], [adapter], [adapter, "--merge"], [base, "--adapter", adapter]):
        sample.main(["--init-from", *init, *greedy])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    expected = peft_model.generate(input_ids=torch.tensor([[97, 98]]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, 2:].tolist()
    assert produced == [expected] * 5 and len(set(expected)) > 2


def sample_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """sample.py's one-line usage error (exit status 2) for argv."""
    with pytest.raises(SystemExit) as exited:
        sample.main([*argv, "--prompt", "ab", "--max-new-tokens", "2", "--device", "cpu"])
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_sample_py_adapter_mistakes_are_usage_errors_naming_the_flag_and_the_fix(lora_out, hf_gpt2_dir, tmp_path,
                                                                                 capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    adapter = lora_out["adapter"]
    err = sample_usage_error(["--init-from", str(lora_out["base"]), "--adapter", str(tmp_path)], capsys)
    assert "argument --adapter:" in err and "is no adapter directory" in err
    err = sample_usage_error(["--init-from", str(hf_gpt2_dir), "--adapter", str(adapter)], capsys)
    assert "argument --adapter:" in err and "export a GPT-2 merged instead" in err
    narrow = tmp_path / "narrow"  # a Llama of other widths: the adapter's shapes do not fit it
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=257)).save_pretrained(narrow)
    err = sample_usage_error(["--init-from", str(narrow), "--adapter", str(adapter), "--encoding", "bytes"], capsys)
    assert "argument --adapter: the adapter does not fit the model: shape mismatch" in err
    orphan = tmp_path / "orphan"  # an adapter directory that does not name its base
    shutil.copytree(adapter, orphan)
    config = json.loads((orphan / "adapter_config.json").read_text())
    (orphan / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    err = sample_usage_error(["--init-from", str(orphan)], capsys)
    assert "argument --init-from:" in err and "names no base model" in err and f"--adapter {orphan}" in err
    (orphan / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "no-such-dir"}))
    err = sample_usage_error(["--init-from", str(orphan)], capsys)
    assert "argument --init-from: 'no-such-dir' is no file" in err and "pass the base as --init-from" in err


def test_export_hf_adapter_of_a_run_without_adapters_or_of_a_gpt2_is_refused_naming_the_fix(lora_out, hf_gpt2_dir,
                                                                                            tmp_path):
    state = load_checkpoint(lora_out["last"])
    del state["lora"], state["base"]
    save_checkpoint(state, tmp_path / "full.pt")  # as if every weight trained
    with pytest.raises(SystemExit, match="holds no adapters .* export it without --adapter"):
        export_hf.main([str(tmp_path / "full.pt"), str(tmp_path / "out"), "--adapter"])
    lora_run(tmp_path, hf_gpt2_dir, "gpt2", "train.max_steps=1")
    with pytest.raises(SystemExit, match="as an adapter: .* export a GPT-2 merged instead"):
        export_hf.main([str(tmp_path / "gpt2"), str(tmp_path / "out"), "--adapter"])
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):  # argparse: an adapter is written in fp32
        export_hf.main([str(tmp_path / "gpt2"), str(tmp_path / "out"), "--adapter", "--dtype", "bf16"])


def test_init_from_an_adapter_dir_starts_from_its_base_with_the_adapters_merged_ours_or_peft(lora_out, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    idx = torch.randint(0, 257, (2, 13))
    init = resolve_init(make_cfg(tmp_path, f"init_from={lora_out['adapter']}"))
    assert init.gpt_config.vocab_size == 257 and init.encoding == str(lora_out["adapter"].resolve())  # its tokenizer
    merged = checkpoint_model(lora_out["last"], merge=True).eval()
    torch.testing.assert_close(init.model().eval()(idx)[0], merged(idx)[0], atol=1e-6, rtol=0)

    made = get_peft_model(AutoModelForCausalLM.from_pretrained(lora_out["base"]),
                          LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "down_proj"]))
    randomize_adapters(made)
    made.save_pretrained(tmp_path / "peft")  # base_model_name_or_path: the directory the base came from
    init = resolve_init(make_cfg(tmp_path, f"init_from={tmp_path / 'peft'}", "data.encoding=bytes"))
    torch.testing.assert_close(init.model().eval()(idx)[0], made.eval()(idx).logits, atol=1e-5, rtol=0)

    # A run trains every merged weight (lora.rank=0), or fresh adapters on top, which load back onto that base.
    common = ["data.encoding=bytes", "train.max_steps=1", "wandb.mode=disabled", "train.dtype=fp32"]
    full = train(make_cfg(tmp_path, f"init_from={lora_out['adapter']}", *common), tmp_path / "full", root=tmp_path)
    assert full["n_trainable_params"] == full["n_params"]
    lora_run(tmp_path, lora_out["adapter"], "on-top", "train.max_steps=1")
    assert load_checkpoint(tmp_path / "on-top")["base"]["init_from"] == str(lora_out["adapter"])
    checkpoint_model(tmp_path / "on-top")

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": ""}))
    with pytest.raises(LoRAError, match="names no base model: set its base_model_name_or_path"):
        resolve_init(make_cfg(tmp_path, f"init_from={tmp_path / 'peft'}"))


def test_gpt2_family_adapters_merge_and_recompute_under_activation_checkpointing_to_the_same_gradients():
    from model import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, block_size=16, vocab_size=64,
                          attention="naive"))
    base = GPT(model.config)
    base.load_state_dict(model.state_dict())
    add_lora(model, LoRAConfig(rank=2, alpha=4, targets=["all"]))  # q, k, v, o, up, down: gate is llama's
    randomize_adapters(model)
    idx = torch.randint(0, 64, (2, 16))
    grads = []
    for mode in ("none", "full"):
        model.set_activation_checkpointing(mode)
        model.zero_grad()
        model.train()(idx, idx)[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    expected = model.eval()(idx)[0]
    assert not torch.allclose(expected, base.eval()(idx)[0])
    merge_lora(model)
    torch.testing.assert_close(model(idx)[0], expected, atol=1e-5, rtol=0)


def test_the_lora_llama_preset_is_rank_16_alpha_32_on_every_linear_layer():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides=["+experiment=lora_llama"]))
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, cfg.train.learning_rate) == (16, 32.0, ["all"], 2e-4)
    validate(cfg)  # a pretrained init_from: the preset's SmolLM2-135M
