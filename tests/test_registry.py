"""The attention registry (model/attention.py) is the one list of backends: a backend added there is accepted by the
run config's schema, the model, sample.py and the benchmark scripts; a name it lacks fails naming the key and the
choices."""

import pytest
from helpers import make_cfg

import sample
from model import GPT, GPTConfig
from model import attention as registry
from scripts import bench_distributed, bench_generate, compare_backends
from training.config import validate


@pytest.fixture
def mine(monkeypatch: pytest.MonkeyPatch) -> str:
    """A backend registered the way a new one is: its function in BACKENDS (the naive one, under another name)."""
    monkeypatch.setitem(registry.BACKENDS, "mine", registry.naive_attention)
    return "mine"


def test_a_backend_added_to_the_registry_is_accepted_everywhere(tmp_path, mine):
    validate(make_cfg(tmp_path, f"attention.name={mine}"))
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11, attention=mine))
    assert model.transformer.h[0].attn.attend is registry.naive_attention
    assert sample.parse_args(["--init-from", "gpt2", "--attention", mine]).attention == mine
    assert bench_generate.parse_args(["--attention", f"sdpa,{mine}"]).attention == ["sdpa", mine]
    assert bench_distributed.parse_args(["--backends", f"sdpa,{mine}"]).backends == ["sdpa", mine]
    assert compare_backends.parse_args(["--backends", mine]).backends == [mine]
    assert mine in compare_backends.parse_args([]).backends  # the default sweep has it too


def test_a_backend_not_in_the_registry_is_refused_with_the_choices(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"attention.name='mine': choose one of naive, sdpa, triton$"):
        validate(make_cfg(tmp_path, "attention.name=mine"))
    for parse, argv in ((sample.parse_args, ["--init-from", "gpt2", "--attention", "mine"]),
                        (bench_generate.parse_args, ["--attention", "sdpa,mine"]),
                        (bench_distributed.parse_args, ["--backends", "sdpa,mine"])):
        with pytest.raises(SystemExit):
            parse(argv)
        error = capsys.readouterr().err
        assert "mine" in error and "naive, sdpa, triton" in error.replace("'", ""), error


def test_every_backend_accepts_dropout():
    for name in registry.BACKENDS:
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=11, attention=name, dropout=0.1))
