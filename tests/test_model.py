"""The GPT model and its attention backends (CPU): init loss, backend agreement, pinned SDPA kernels, errors."""

import math
import os

import pytest
import torch

from model import GPT, GPTConfig
from model.attention import get_attention, naive_attention
from model.loss import IGNORE_INDEX

needs_triton = pytest.mark.skipif(  # these tests run the kernel on CPU tensors, through the Triton interpreter
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1",
)


def tiny(**kw) -> GPTConfig:
    base = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=101, attention="naive")
    return GPTConfig(**{**base, **kw})


def test_loss_at_init_is_log_vocab():
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=1000, pad_vocab_multiple=1, n_embd=64))
    idx, targets = torch.randint(0, 1000, (2, 2, 32))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(1000)) < 0.1


def test_vocab_is_padded_the_head_is_tied_and_the_residual_init_is_scaled():
    model = GPT(tiny(vocab_size=50257, pad_vocab_multiple=64))
    assert model.transformer.wte.weight.shape[0] == 50304
    assert model.lm_head.weight is model.transformer.wte.weight
    logits, loss = model(torch.randint(0, 50257, (3, 7)))
    assert logits.shape == (3, 7, 50257) and loss is None
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * 2)) < 0.003  # GPT-2's scaled residual init


def _zero_filled_shapes(fn) -> list[list[int]]:
    """Shapes of the tensors that fn (run under torch.profiler) fills with zeros."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return [e.input_shapes[0] for e in prof.events() if e.name in ("aten::zero_", "aten::fill_") and e.input_shapes]


@pytest.mark.parametrize("return_logits", [True, False])
def test_compiled_training_step_without_logits_materialises_no_logit_gradient(return_logits):
    """The training loop calls model(x, y, return_logits=False): compiled, the logits then are no graph output, and
    AOTAutograd does not zero-fill a (B, T, vocab) gradient for them in every backward (it does with them)."""
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=128))
    step = torch.compile(model, backend="aot_eager")
    idx, targets = torch.randint(0, 128, (2, 3, 16))

    def train_step():
        logits, loss = step(idx, targets, return_logits=return_logits)
        assert (logits is None) != return_logits
        loss.backward()

    train_step()  # compiles
    logit_shaped = [s for s in _zero_filled_shapes(train_step) if s == [3, 16, 128]]
    assert bool(logit_shaped) == return_logits


def test_loss_without_logits_is_the_same_loss():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx, targets = torch.randint(0, 101, (2, 2, 9))
    logits, loss = model(idx, targets)
    none, same = model(idx, targets, return_logits=False)
    assert none is None and torch.equal(loss, same)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_chunked_loss_equals_the_plain_loss_and_gradients(family):
    """model.loss_chunk_tokens: the training loss over chunks of tokens (model/loss.py) is the plain path's loss, and
    every parameter's gradient (the tied head's included) is the same; the chunks do not divide B*T = 38."""
    torch.manual_seed(0)
    plain = GPT(tiny(family=family, vocab_size=1000))
    chunked = GPT(tiny(family=family, vocab_size=1000, loss_chunk_tokens=8))
    chunked.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 1000, (2, 2, 19))
    targets[0, :3] = IGNORE_INDEX  # ignored positions
    losses = []
    for model in (plain, chunked):
        _, loss = model(idx, targets, return_logits=False)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


def _logits_and_grads(config: GPTConfig, state: dict, idx: torch.Tensor, targets: torch.Tensor):
    model = GPT(config)
    model.load_state_dict(state)
    logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "backend",
    [dict(attention="sdpa"), dict(attention="sdpa", sdpa_backend="math"), dict(attention="sdpa", sdpa_backend="flash"),
     pytest.param(dict(attention="triton"), marks=needs_triton)],
)
@pytest.mark.parametrize("heads", [dict(n_head=2), dict(n_head=4, n_kv_head=2, n_embd=64),
                                   dict(n_head=4, n_kv_head=1, n_embd=64)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("family", [dict(family="gpt2"), dict(family="llama", bias=False, qkv_bias=True)],
                         ids=["gpt2", "llama"])
def test_backends_agree_with_naive(backend, heads, family):
    torch.manual_seed(1)
    ref_model = GPT(tiny(**heads, **family))
    state = ref_model.state_dict()
    idx, targets = torch.randint(0, 101, (2, 2, 19))  # T=19: not a multiple of any block size
    ref_logits, ref_grads = _logits_and_grads(tiny(**heads, **family), state, idx, targets)
    logits, grads = _logits_and_grads(tiny(**backend, **heads, **family), state, idx, targets)
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-5, rtol=1e-4, msg=name)


@needs_triton
@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["mha", "mqa"])
def test_triton_model_reads_the_fused_projection_packed(monkeypatch: pytest.MonkeyPatch, n_kv_head: int):
    """attention=triton trains through flash_attention_qkvpacked (one qkv gradient); a KV-cache prefill splits q/k/v."""
    import kernels

    calls = {"packed": 0, "split": 0}
    for name, key in (("flash_attention_qkvpacked", "packed"), ("flash_attention", "split")):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, fn=fn, key=key, **kw: calls.__setitem__(key, calls[key] + 1)
                            or fn(*a, **kw))
    model = GPT(tiny(attention="triton", n_kv_head=n_kv_head))
    assert model.transformer.h[0].attn.c_attn.weight.shape == ((2 + 2 * n_kv_head) * 16, 32)
    _, loss = model(*torch.randint(0, 101, (2, 2, 9)))
    loss.backward()
    assert calls == {"packed": 2, "split": 0}  # one call per layer
    model.generate(torch.randint(0, 101, (1, 5)), max_new_tokens=1)
    assert calls == {"packed": 2, "split": 2}


def test_naive_attention_matches_float64_reference():
    q, k, v = torch.randn(3, 2, 4, 11, 8, dtype=torch.float64)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    scores = scores + torch.triu(torch.full((11, 11), float("-inf"), dtype=torch.float64), diagonal=1)
    torch.testing.assert_close(naive_attention(q, k, v, causal=True), scores.softmax(-1) @ v)


@pytest.mark.parametrize("pinned", ["efficient", "cudnn"])
def test_pinned_sdpa_backend_that_cannot_run_fails_clearly(pinned):
    if torch.cuda.is_available():
        pytest.skip("on a GPU these backends may run")
    attend = get_attention("sdpa", pinned)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=f"attention.sdpa_backend={pinned} cannot run"):
        attend(q, q, q, causal=True)


@pytest.mark.parametrize(
    "kw, message",
    [(dict(n_embd=30, n_head=4), "divisible by model.n_head"), (dict(attention="flash"), "unknown attention backend"),
     (dict(attention="naive", sdpa_backend="math"),
     "only applies to attention=sdpa"), (dict(dropout=1.5), "model.dropout"),
     (dict(n_head=4, n_kv_head=3), "model.n_kv_head=3 must divide model.n_head=4"),
     (dict(n_head=2, n_kv_head=4), "model.n_kv_head=4 must divide model.n_head=2"),
     (dict(family="mamba"), "unknown model.family='mamba'"), (dict(family="llama", n_embd=30, n_head=2), "even"),
     (dict(family="llama", rope_scaling={"rope_type": "yarn"}), "rope_type='yarn' is not implemented"),
     (dict(family="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks low_freq_factor"),
     (dict(loss_chunk_tokens=-1), "model.loss_chunk_tokens must be >= 0")],
)
def test_bad_model_config_fails_naming_the_key(kw, message):
    with pytest.raises(ValueError, match=message):
        GPT(tiny(**kw))  # shapes fail as the config is made, attention settings as the model picks its backend


def test_sequence_longer_than_block_size_is_rejected():
    with pytest.raises(ValueError, match="model.block_size"):
        GPT(tiny())(torch.zeros(1, 33, dtype=torch.long))


def test_greedy_generate_is_deterministic_and_sees_only_the_last_block_size_tokens():
    torch.manual_seed(0)
    model = GPT(tiny(block_size=8)).eval()
    prompt = torch.randint(0, 101, (2, 5))
    out = model.generate(prompt, 10, temperature=0.0)  # 15 tokens: the context outgrows block_size=8
    assert out.shape == (2, 15) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, 10, temperature=0.0))
    with torch.no_grad():
        for t in range(5, 15):  # each token is the argmax after the (at most) 8 tokens before it, the cropped context
            logits, _ = model(out[:, max(0, t - 8) : t])
            assert torch.equal(out[:, t], logits[:, -1].argmax(-1)), t


def saved_bytes_and_grads(model: GPT, idx: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps for the backward in one training forward (seeded: the same dropout masks), and the
    gradients."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.zero_grad()
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    loss.backward()
    return saved, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family, attention", [("gpt2", "sdpa"), ("llama", "naive"),
                                               pytest.param("llama", "triton", marks=needs_triton)])
def test_activation_checkpointing_saves_less_and_gives_the_same_gradients(family, attention):
    """full keeps less than selective (every other block) keeps less than none, mlp (the activation) less than none;
    the gradients are bit-equal, with dropout on (the recompute replays the forward's RNG state: the same masks, the
    kernel's seed included)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=101, dropout=0.2,
                          family=family, bias=family == "gpt2", attention=attention)).train()
    idx = torch.randint(0, 101, (2, 32))
    results = {}
    for mode in ("none", "mlp", "selective", "full"):
        model.set_activation_checkpointing(mode)
        results[mode] = saved_bytes_and_grads(model, idx)
    sizes = {m: r[0] for m, r in results.items()}
    assert sizes["full"] < sizes["selective"] < sizes["none"] and sizes["mlp"] < sizes["none"], sizes
    for mode in ("mlp", "selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(results[mode][1], results["none"][1], strict=True)), mode
    assert [b.recompute for b in model.transformer.h] == [True] * 4
    model.set_activation_checkpointing("selective")
    assert [b.recompute for b in model.transformer.h] == [False, True, False, True]
    with pytest.raises(ValueError, match="use none, mlp, selective or full"):
        model.set_activation_checkpointing("some")


# ----------------------------------------------------------------------------------------------------------------------
# Packed rows: GPT.forward(positions=...) runs each example as if alone in its row
# ----------------------------------------------------------------------------------------------------------------------
PACKED_LENGTHS = [7, 1, 20, 9]  # T = 37: odd, an example of one token


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["naive", "sdpa", pytest.param("triton", marks=needs_triton)])
def test_packed_rows_give_each_example_its_logits_and_gradients_alone(family: str, attention: str) -> None:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=4, n_kv_head=2 if family == "llama" else None, n_embd=64, block_size=64,
                       vocab_size=100, attention=attention, family=family)
    model = GPT(config)
    if attention != "triton":  # the interpreter's kernel runs fp32; the others are checked in float64
        model = model.double()
    examples = [torch.randint(0, 100, (n,)) for n in PACKED_LENGTHS]
    targets = [torch.randint(0, 100, (n,)) for n in PACKED_LENGTHS]
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]  # (1, 37)
    packed_logits, packed_loss = model(torch.cat(examples)[None], torch.cat(targets)[None], positions=positions)
    packed_loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = [model(x[None], y[None]) for x, y in zip(examples, targets, strict=True)]
    # the mean over all tokens of the packed row = the token-weighted mean of the examples' own means
    loss = sum(loss * n for (_, loss), n in zip(alone, PACKED_LENGTHS, strict=True)) / sum(PACKED_LENGTHS)
    loss.backward()
    tol = 1e-5 if attention == "triton" else 1e-10
    torch.testing.assert_close(packed_logits, torch.cat([logits for logits, _ in alone], dim=1), atol=tol, rtol=0)
    for got, p in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, atol=tol, rtol=tol)


def test_flex_attention_document_mask_matches_the_naive_mask() -> None:
    """The GPU path of attention=sdpa for packed rows (FlexAttention's BlockMask), forward only (FlexAttention has no
    CPU backward): the same output as the naive backend's explicit mask."""
    from model.attention import flex_documents, naive_documents, sdpa_attention

    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None].repeat(2, 1)  # (2, 37)
    q, k, v = torch.randn(2, 4, 37, 16), torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16)
    with torch.no_grad():
        flex = sdpa_attention(q, k, v, documents=flex_documents(positions))
        naive = naive_attention(q, k, v, documents=naive_documents(positions))
    torch.testing.assert_close(flex, naive, atol=1e-5, rtol=0)
