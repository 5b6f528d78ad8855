"""sample.py --chat: the conversation rendered with the model's chat template and its generation prompt, the answer
up to the template's end-of-turn token (model/generate.py: stream's stop_tokens), one-shot, batched and in a
terminal's conversation, and its usage errors.

    TRITON_INTERPRET=1 python -m pytest tests/test_chat.py -q

Offline and small: the tokenizer is a byte-level BPE trained here on a few sentences with a ChatML chat template in
its tokenizer_config.json (as tests/test_sft.py builds it), the model a random transformers Llama whose LM head is
set to make <|im_end|> the greedy token a few tokens into one answer. What to expect is computed by transformers:
apply_chat_template renders, generate(do_sample=False) gives the greedy tokens.
"""

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import CHATML, ROOT, SENTENCES, make_tokenizer
from tokenizers import Tokenizer

import sample
from data.sft import PROMPT_TEMPLATES, ChatTemplate
from model.generate import stream

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYSTEM = {"role": "system", "content": "be brief"}
QUESTION = {"role": "user", "content": "what is two plus two"}
STOP_AFTER = 3  # the answer to [SYSTEM, QUESTION] is this many tokens, then <|im_end|>
NEW_TOKENS = 20
COMMON = ["--chat", "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """A random transformers Llama with a ChatML tokenizer whose end of turn, <|im_end|>, is its eos too (as
    SmolLM2-Instruct's), its LM head's <|im_end|> row set so that the greedy answer to [SYSTEM, QUESTION] ends after
    STOP_AFTER tokens: the row is orthogonal to the hidden states of the answer's earlier steps (a logit of 0 there,
    below their greedy token's) and exceeds the greedy logit at step STOP_AFTER."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = make_tokenizer(tmp_path_factory.mktemp("chat_model"), CHATML, CHATML_SPECIALS, eos_token="<|im_end|>")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(tokenizer), max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # large weights: answers that vary with the prompt (small ones give every prompt one)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    prompt = render(tokenizer, [SYSTEM, QUESTION])
    answer = model.generate(torch.tensor([prompt]), max_new_tokens=STOP_AFTER, do_sample=False)[0].tolist()
    with torch.no_grad():
        states = model.model(torch.tensor([answer])).last_hidden_state[0, len(prompt) - 1:]  # (STOP_AFTER + 1, C)
        earlier, last = states[:-1], states[-1]
        q, _ = torch.linalg.qr(earlier.T)  # an orthonormal basis of the earlier steps' states
        row = last - q @ (q.T @ last)
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] = \
            (model.lm_head(last).max() + 5.0) * row / row.dot(last)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(chat_model_dir):
    """transformers' tokenizer and model of chat_model_dir: what the tests expect is theirs."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    return AutoTokenizer.from_pretrained(chat_model_dir), LlamaForCausalLM.from_pretrained(chat_model_dir).eval()


def render(tokenizer, messages: list[dict], chat_template: str | None = None) -> list[int]:
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def greedy_answer(hf, prompt: list[int]) -> tuple[list[int], str]:
    """transformers' NEW_TOKENS greedy tokens after the prompt, and their text up to the first <|im_end|>."""
    tokenizer, model = hf
    new = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return new, tokenizer.decode(new[: new.index(end)] if end in new else new)


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Each call of sample.py's stream: its prompts (the rows of idx, each cut to its length) and the steps it gave."""
    recorded = []

    def recording_stream(model, idx, *args, lengths, **kwargs):
        call = {"prompts": [row[:n].tolist() for row, n in zip(idx, lengths, strict=True)], "steps": 0}
        recorded.append(call)
        for token in stream(model, idx, *args, lengths=lengths, **kwargs):
            call["steps"] += 1
            yield token

    monkeypatch.setattr(sample, "stream", recording_stream)
    return recorded


def test_chat_prompt_prints_the_greedy_answer_up_to_the_end_of_turn_token_and_stops_there(chat_model_dir, hf, calls,
                                                                                         capsys):
    sample.main(["--init-from", str(chat_model_dir), *COMMON, "--system", SYSTEM["content"],
                 "--prompt", QUESTION["content"]])
    prompt = render(hf[0], [SYSTEM, QUESTION])
    new, answer = greedy_answer(hf, prompt)
    end = hf[0].convert_tokens_to_ids("<|im_end|>")
    assert new.index(end) == STOP_AFTER and answer  # the fixture's answer: STOP_AFTER tokens, then <|im_end|>
    assert calls == [{"prompts": [prompt], "steps": STOP_AFTER + 1}]  # stopped at <|im_end|>, not after 20 tokens
    assert capsys.readouterr().out == answer + "\n"  # the answer alone: no <|im_end|>


def test_chat_answers_several_prompts_in_one_batch_each_cut_at_its_end_of_turn(chat_model_dir, calls, capsys):
    args = ["--init-from", str(chat_model_dir), *COMMON, "--system", SYSTEM["content"]]
    sample.main([*args, "--prompt", QUESTION["content"], "--prompt", "and the white dog", "--num-samples", "2"])
    together = capsys.readouterr().out
    alone = []
    for text in (QUESTION["content"], "and the white dog"):
        sample.main([*args, "--prompt", text])
        alone.append(capsys.readouterr().out)
    assert [len(call["prompts"]) for call in calls] == [4, 1, 1]
    # alone, each stops at its end of turn; the batch at its last row's, before --max-new-tokens
    assert calls[0]["steps"] == max(call["steps"] for call in calls[1:]) < NEW_TOKENS
    assert together == ("\n" + "-" * 40 + "\n").join([alone[0], alone[0], alone[1], alone[1]])


class Terminal(io.StringIO):
    """A stdin that is a terminal, holding what the user types."""

    def isatty(self) -> bool:
        return True


def test_terminal_chat_keeps_each_answer_as_an_assistant_turn_until_an_empty_line(chat_model_dir, hf, calls, capsys,
                                                                                 monkeypatch):
    monkeypatch.setattr(sys, "stdin", Terminal(f"{QUESTION['content']}\nand the white dog\n\nnever asked\n"))
    sample.main(["--init-from", str(chat_model_dir), *COMMON, "--system", SYSTEM["content"]])
    first = render(hf[0], [SYSTEM, QUESTION])
    _, answer = greedy_answer(hf, first)
    second = render(hf[0], [SYSTEM, QUESTION, {"role": "assistant", "content": answer},
                            {"role": "user", "content": "and the white dog"}])
    _, second_answer = greedy_answer(hf, second)
    assert [call["prompts"] for call in calls] == [[first], [second]]
    assert capsys.readouterr().out == f"> {answer}\n> {second_answer}\n> "


def test_model_without_a_chat_template_is_a_usage_error_naming_chat_template(chat_model_dir, hf, calls, capsys,
                                                                             tmp_path):
    plain = shutil.copytree(chat_model_dir, tmp_path / "base")
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    args = ["--init-from", str(plain), *COMMON, "--prompt", QUESTION["content"]]
    with pytest.raises(SystemExit) as exited:
        sample.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "error: argument --chat-template: " in err and "has no chat template" in err
    sample.main([*args, "--chat-template", "chatml"])  # a named plain template renders for it
    assert calls[0]["prompts"] == [render(hf[0], [QUESTION], PROMPT_TEMPLATES["chatml"])]
    with pytest.raises(SystemExit):  # byte tokens read chatml's <|im_end|> as 10 tokens: no single one to stop at
        sample.main([*args, "--chat-template", "chatml", "--encoding", "bytes"])
    assert "error: argument --chat-template: the chat template closes an assistant turn with '<|im_end|>'" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv, terminal, expected", [
    (["--system", "be brief"], False, "argument --system: only with --chat"),
    (["--chat-template", "chatml"], False, "argument --chat-template: only with --chat"),
    (["--chat", "--chat-template", "vicuna"], False, "argument --chat-template: 'vicuna' is no plain template"),
    (["--chat", "--num-samples", "2"], True, "argument --num-samples: a conversation in the terminal"),
    (["--chat"], False, "argument --prompt: --chat read no message from stdin"),
], ids=["system", "template", "unknown-template", "terminal-samples", "empty-stdin"])
def test_chat_flag_misuse_is_a_usage_error_naming_the_flag(argv, terminal, expected, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", Terminal("") if terminal else io.StringIO(""))
    with pytest.raises(SystemExit) as exited:
        sample.main(["--init-from", "nowhere", *argv])  # found before any model loads
    assert exited.value.code == 2 and f"error: {expected}" in capsys.readouterr().err


def test_end_of_turn_tokens_are_the_templates_the_tokenizers_and_the_generation_configs(tmp_path):
    folder = make_tokenizer(tmp_path / "model", CHATML, CHATML_SPECIALS)  # eos <|endoftext|>; turns end <|im_end|>
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    assert ChatTemplate(str(folder), None).end_of_turn() == sorted({vocab["<|im_end|>"], vocab["<|endoftext|>"], 5, 9})
    assert ChatTemplate("bytes", "alpaca").end_of_turn() == [256]  # alpaca closes with the end-of-text token
    with pytest.raises(ValueError, match="reads as 10 tokens"):
        ChatTemplate("bytes", "chatml").end_of_turn()


def test_an_sft_run_exported_to_transformers_answers_as_sample_py_chat_does(chat_model_dir, tmp_path, capsys):
    # The round trip of docs/instruction-tuning.md: fine-tune on chats, export, chat in transformers; the base keeps
    # its template in chat_template.jinja, as newer transformers versions save it, which the export carries.
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts import export_hf
    from training.loop import train

    base = Path(shutil.copytree(chat_model_dir, tmp_path / "base"))
    settings = json.loads((base / "tokenizer_config.json").read_text())
    (base / "chat_template.jinja").write_text(settings.pop("chat_template"))
    (base / "tokenizer_config.json").write_text(json.dumps(settings))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": s},
                                                      {"role": "assistant", "content": "four"}]}) + "\n"
                             for s in SENTENCES * 2))
    overrides = [f"init_from={base}", "data=chat_local", f"data.data_files=[{chats}]",
                 f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.25", "model.block_size=64",
                 "train.batch_size=4", "train.max_steps=2", "train.eval_interval=2", "train.eval_batches=1",
                 "train.warmup_steps=1", "train.dtype=fp32", "train.device=cpu", "wandb.mode=disabled"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        train(OmegaConf.to_object(compose("config", overrides=overrides)), tmp_path / "run", root=tmp_path)
    export_hf.main([str(tmp_path / "run"), str(tmp_path / "hf")])
    capsys.readouterr()
    sample.main(["--init-from", str(tmp_path / "run"), *COMMON, "--prompt", QUESTION["content"]])
    ours = capsys.readouterr().out

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")  # the exported chat template and tokenizer
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    answer = greedy_answer((tokenizer, model), render(tokenizer, [QUESTION]))[1]
    assert ours == answer + "\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_gpu_chat_on_the_cuda_graph_decode_path_stops_at_the_end_of_turn_token(chat_model_dir, hf, calls, capsys,
                                                                              attention):
    """On a GPU the decode steps replay a CUDA graph (sample.py's default there); in fp32 the greedy answer is still
    transformers', cut at <|im_end|>, and the generation stops at it."""
    gpu = [arg for arg in COMMON if arg not in ("--device", "cpu")]
    sample.main(["--init-from", str(chat_model_dir), *gpu, "--device", "cuda", "--dtype", "fp32", "--attention",
                 attention, "--system", SYSTEM["content"], "--prompt", QUESTION["content"]])
    prompt = render(hf[0], [SYSTEM, QUESTION])
    _, answer = greedy_answer(hf, prompt)
    assert calls == [{"prompts": [prompt], "steps": STOP_AFTER + 1}]
    assert capsys.readouterr().out == answer + "\n"
