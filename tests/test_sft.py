"""Tests of instruction and chat data (data/sft.py, data/loader.py: ExampleLoader) and of a fine-tuning run on them.

    TRITON_INTERPRET=1 python -m pytest tests/test_sft.py -q

Offline and small: the tokenizer is a byte-level BPE trained here on a few sentences, the chat templates (ChatML-
style and Llama 3's) are written here into its tokenizer_config.json, the model is a random transformers Llama, and
the loader tests read example files written here directly.
"""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CHATML, ROOT, make_tokenizer  # helpers also registers the config schema
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from data import DataConfig, ExampleLoader, PreparedExamples, TokenLoader, get_encoding, prepare_dataset
from data.loader import pack
from data.sft import PROMPT_TEMPLATES
from model import GPT, GPTConfig
from model.loss import IGNORE_INDEX as IGNORE

needs_triton = pytest.mark.skipif(  # the kernel on CPU tensors, through the Triton interpreter
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1",
)

# Meta-Llama-3-8B-Instruct's, verbatim
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the black cat"},
     {"role": "assistant", "content": "sat on the red mat"}, {"role": "user", "content": "and the white dog"},
     {"role": "assistant", "content": " it sat on the green mat too "}],  # spaces: Llama 3's template trims them
    [{"role": "user", "content": "what is two"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "plus two"}],  # ends on a user turn
    [{"role": "user", "content": "be kind"}, {"role": "assistant", "content": ""}],  # an empty answer: its end-of-turn
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chat_config(tmp_path: Path, encoding: Path | str, rows: list[dict], **overrides) -> DataConfig:
    """Rows in a jsonl file; val is the last example (tail), so example i of train.bin is row i."""
    write_jsonl(tmp_path / "rows.jsonl", rows)
    settings = dict(name="sft", format="chat", source="files", data_files=["rows.jsonl"], encoding=str(encoding),
                    val_fraction=0.25, val_split="tail", cache_dir="cache")
    return DataConfig(**(settings | overrides))


def examples_of(data: PreparedExamples) -> list[tuple[list[int], list[int]]]:
    """Every example's (ids, mask), train then val: the rows in order under val_split=tail."""
    out = []
    for split in ("train", "val"):
        ex = data.examples(split)
        for start, n in zip(ex.starts.tolist(), ex.lengths.tolist(), strict=True):
            out.append((ex.tokens[start : start + n].tolist(), ex.mask[start : start + n].tolist()))
    return out


# --- rendering and the mask ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template_dir(request, tmp_path_factory) -> Path:
    """A tokenizer whose chat template is TEMPLATES[name], in a folder named after it."""
    folder = tmp_path_factory.mktemp("templates") / request.param
    return make_tokenizer(folder, TEMPLATES[request.param], bos_token="<|begin_of_text|>")


def test_tokens_equal_transformers_apply_chat_template(template_dir, tmp_path):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(template_dir)
    rows = [{"messages": m} for m in CONVERSATIONS]
    data = prepare_dataset(chat_config(tmp_path, template_dir, rows), root=tmp_path)
    for (ids, _), messages in zip(examples_of(data), CONVERSATIONS, strict=True):
        assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    # data.system_prompt is the system message of the conversations without one
    data = prepare_dataset(chat_config(tmp_path, template_dir, rows, system_prompt="be kind"), root=tmp_path)
    for (ids, _), messages in zip(examples_of(data), CONVERSATIONS, strict=True):
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "be kind"}, *messages]
        assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def expected_pieces(name: str, messages: list[dict], enc) -> tuple[list[int], list[int]]:
    """The example built piece by piece, as the template lays it out: each message's header and, for an assistant,
    its answer and end-of-turn token trained (1), nothing else."""
    ids, mask = [], []

    def add(piece: list[int], trained: bool) -> None:
        ids.extend(piece)
        mask.extend([int(trained)] * len(piece))

    special = lambda token: [enc._tokenizer.token_to_id(token)]  # noqa: E731
    text = lambda s: enc.encode_ordinary_batch([s])[0] if s else []  # noqa: E731
    if name == "chatml" and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": "you are a helpful assistant"}, *messages]
    if name == "llama3":
        add(special("<|begin_of_text|>"), False)
    for m in messages:
        answer = m["role"] == "assistant"
        if name == "chatml":
            add(special("<|im_start|>") + text(m["role"] + "\n"), False)
            add(text(m["content"]) + special("<|im_end|>"), answer)
            add(text("\n"), False)
        else:
            add(special("<|start_header_id|>") + text(m["role"]) + special("<|end_header_id|>") + text("\n\n"), False)
            add(text(m["content"].strip()) + special("<|eot_id|>"), answer)
    return ids, mask


def test_mask_covers_exactly_the_answers_and_their_end_of_turn_tokens(template_dir, tmp_path):
    name = template_dir.name
    enc = get_encoding(str(template_dir))
    data = prepare_dataset(chat_config(tmp_path, template_dir, [{"messages": m} for m in CONVERSATIONS]),
                           root=tmp_path)
    for (ids, mask), messages in zip(examples_of(data), CONVERSATIONS, strict=True):
        expected_ids, expected_mask = expected_pieces(name, messages, enc)
        assert ids == expected_ids
        for position, (token, trained, expected) in enumerate(zip(ids, mask, expected_mask, strict=True)):
            assert trained == expected, (position, enc.decode([token]), enc.decode(ids))


def test_train_on_all_trains_every_token(template_dir, tmp_path):
    data = prepare_dataset(chat_config(tmp_path, template_dir, [{"messages": m} for m in CONVERSATIONS],
                                       train_on="all"), root=tmp_path)
    assert all(set(mask) == {1} for _, mask in examples_of(data))


def test_alpaca_rows_on_byte_tokens_train_on_the_output_and_end_of_text(tmp_path):
    rows = [{"instruction": "add the numbers", "input": "2 and 2", "output": "4"},
            {"instruction": "name a colour", "input": "", "output": "réd"},
            {"instruction": "count", "input": None, "output": 3}]  # a number, as a csv column may read
    data = prepare_dataset(chat_config(tmp_path, "bytes", rows, format="instruction", prompt_template="alpaca",
                                       val_fraction=0.3), root=tmp_path)
    enc = get_encoding("bytes")
    (ids0, mask0), (ids1, mask1), (ids2, mask2) = examples_of(data)
    preamble = "Below is an instruction that describes a task. Write a response that appropriately completes the "
    assert enc.decode(ids0) == (preamble + "request.\n\n### Instruction:\nadd the numbers\n\n2 and 2\n\n"
                                "### Response:\n4<|endoftext|>\n\n")
    for ids, mask, output in ((ids0, mask0, "4"), (ids1, mask1, "réd"), (ids2, mask2, "3")):
        trained = [token for token, m in zip(ids, mask, strict=True) if m]
        assert trained == list(output.encode()) + [enc.eot_token]  # byte by byte, é's two bytes included
    assert "### Instruction:\nname a colour\n\n### Response" in enc.decode(ids1)  # no input: no blank input


def test_a_named_template_renders_as_transformers_renders_it(tmp_path):
    from transformers import AutoTokenizer

    folder = make_tokenizer(tmp_path / "base")  # a base model: no chat template of its own
    theirs = AutoTokenizer.from_pretrained(folder)
    data = prepare_dataset(chat_config(tmp_path, folder, [{"messages": m} for m in CONVERSATIONS],
                                       prompt_template="chatml"), root=tmp_path)
    for (ids, _), messages in zip(examples_of(data), CONVERSATIONS, strict=True):
        assert ids == theirs.apply_chat_template(messages, chat_template=PROMPT_TEMPLATES["chatml"], tokenize=True,
                                                 return_dict=True)["input_ids"]


def test_a_chat_template_jinja_file_beside_the_tokenizer_is_the_models_template(tmp_path):
    from transformers import AutoTokenizer

    folder = make_tokenizer(tmp_path / "model", bos_token="<|begin_of_text|>")  # no chat_template in its config ...
    (folder / "chat_template.jinja").write_text(LLAMA3)  # ... but in the file newer transformers versions write
    data = prepare_dataset(chat_config(tmp_path, folder, [{"messages": m} for m in CONVERSATIONS]), root=tmp_path)
    theirs = AutoTokenizer.from_pretrained(folder)
    for (ids, _), messages in zip(examples_of(data), CONVERSATIONS, strict=True):
        assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert ids.count(theirs.convert_tokens_to_ids("<|eot_id|>")) == len(messages)


def test_examples_are_prepared_once_and_reused(template_dir, tmp_path, monkeypatch):
    cfg = chat_config(tmp_path, template_dir, [{"messages": m} for m in CONVERSATIONS])
    data = prepare_dataset(cfg, root=tmp_path)

    def no_reload(*args, **kwargs):
        raise AssertionError("a prepared folder must be reused, not prepared again")

    monkeypatch.setattr("data.sft.load_rows", no_reload)
    assert prepare_dataset(cfg, root=tmp_path) == data


def test_text_format_reads_the_text_column_of_jsonl_files(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", [{"body": f"document {i}"} for i in range(4)])
    cfg = DataConfig(name="t", source="files", data_files=["docs.jsonl"], text_column="body", encoding="bytes",
                     val_fraction=0.25, cache_dir="cache")
    data = prepare_dataset(cfg, root=tmp_path)
    text = bytes(t for t in np.concatenate([data.tokens("train"), data.tokens("val")]).tolist() if t < 256).decode()
    assert sorted(text.split("document ")[1:]) == ["0", "1", "2", "3"]
    # a text run does not resume from the loader state of an instruction or chat run
    loader = TokenLoader(data, block_size=4, batch_size=1, device="cpu", seed=0)
    with pytest.raises(ValueError, match=r"the checkpoint's loader read examples \(data.format=instruction\|chat\)"):
        loader.load_state_dict({"seed": 0, "epoch": 1, "position": 2, "data": "sft-123"})


# --- bad input ----------------------------------------------------------------------------------------------------

RAISES = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
          + CHATML)
# renders only the last assistant turn, as templates that drop earlier turns' reasoning do
NOT_A_PREFIX = ("{% for message in messages %}{% if message['role'] != 'assistant' or loop.last %}"
                "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}{% endfor %}")
GOOD = [{"messages": CONVERSATIONS[0]}]


@pytest.mark.parametrize("rows, template, overrides, message", [
    ([{"question": "q", "answer": "a"}], CHATML, {},
     r"rows\.jsonl has no column 'messages' \(its columns: \['question', 'answer'\]\), where data.format=chat reads "
     r"conversations: set data.messages_column to the columns that hold them"),
    ([{"instruction": "q", "output": "a"}], CHATML, {},
     r"rows\.jsonl has no column 'messages' .*: these are instructions and their answers: "
     r"set data\.format=instruction"),
    ([{"messages": CONVERSATIONS[0]}], CHATML, {"format": "instruction"},
     r"no column 'instruction' or 'output' .*: these are conversations: set data\.format=chat"),
    (GOOD + [{"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}], CHATML, {},
     r"rows\.jsonl, row 1, column 'messages': message 0 has the role 'human', but the roles are system, user, "
     r"assistant: rename it"),
    (GOOD + [{"messages": [{"role": "user", "content": "hi"}]}], CHATML, {},
     r"rows\.jsonl, row 1, column 'messages': the conversation has no assistant turn, so it has nothing to train on: "
     r"add the assistant's answer, or remove the row"),
    (GOOD + [{"messages": [{"from": "user", "value": "hi"}]}], CHATML, {},
     r"row 1, column 'messages': message 0 is .*not a \{role, content\} pair of strings"),
    (GOOD, None, {}, r"has no chat template \(no chat_template in .*tokenizer_config\.json and no chat_template\.jinja "
     r"beside it\): name a plain prompt template, data\.prompt_template=alpaca\|chatml"),
    (GOOD, CHATML, {"prompt_template": "vicuna"}, r"data\.prompt_template='vicuna': use one of alpaca, chatml"),
    ([{"messages": CONVERSATIONS[1]}], RAISES, {},
     r"rows\.jsonl, row 0: the chat template failed to render the conversation \(TemplateError: System role not "
     r"supported\): fix the row"),
    ([{"messages": CONVERSATIONS[1]}], NOT_A_PREFIX, {},
     r"row 0: the chat template renders the beginning of the conversation differently .*data\.train_on=all"),
], ids=["columns-of-neither-shape", "instruction-columns", "chat-columns", "unknown-role", "no-assistant-turn",
        "not-a-message", "no-chat-template", "unknown-prompt-template", "template-raises", "template-rewrites-turns"])
def test_bad_input_is_one_error_naming_the_row_and_the_fix_and_leaves_no_cache(tmp_path, rows, template, overrides,
                                                                                message):
    from training.launch import is_user_error

    folder = make_tokenizer(tmp_path / "model", template)
    with pytest.raises(ValueError, match=message) as raised:
        prepare_dataset(chat_config(tmp_path, folder, rows, **overrides), root=tmp_path)
    assert is_user_error(raised.value) and "\n" not in str(raised.value)  # train.py: one `error:` line
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_a_template_that_rewrites_earlier_turns_still_trains_on_every_token(tmp_path):
    # with train_on=all nothing is located by rendering prefixes
    folder = make_tokenizer(tmp_path / "model", NOT_A_PREFIX)
    data = prepare_dataset(chat_config(tmp_path, folder, [{"messages": m} for m in CONVERSATIONS], train_on="all"),
                           root=tmp_path)
    assert data.train_examples + data.val_examples == len(CONVERSATIONS)


# --- the loader ---------------------------------------------------------------------------------------------------

def fake_examples(folder: Path, lengths: dict[str, list[int]], first: dict[str, list[int]]) -> PreparedExamples:
    """Example files whose example i of a split has tokens 1000·(i+1) + position (val: + 500), trained from its
    position first[i] on."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = dict(encoding="fake", vocab_size=65_536, eot_token=0, dtype="uint16", max_token_id=0)
    for split, offset in (("train", 0), ("val", 500)):
        tokens = [1000 * (i + 1) + offset + np.arange(n) for i, n in enumerate(lengths[split])]
        meta["max_token_id"] = max(meta["max_token_id"], int(np.concatenate(tokens).max()))
        masks = [np.arange(n) >= f for n, f in zip(lengths[split], first[split], strict=True)]
        np.concatenate(tokens).astype(np.uint16).tofile(folder / f"{split}.bin")
        np.concatenate(masks).astype(np.uint8).tofile(folder / f"{split}.mask")
        np.stack([lengths[split], first[split]], axis=1).astype(np.int64).tofile(folder / f"{split}.index")
        meta[f"n_{split}"], meta[f"{split}_examples"] = int(sum(lengths[split])), len(lengths[split])
    (folder / "meta.json").write_text(json.dumps(meta))
    return PreparedExamples.load(folder)


def uniform(tmp_path: Path, n_train: int = 12, n_val: int = 5, length: int = 6, first: int = 3) -> PreparedExamples:
    return fake_examples(tmp_path / "ex", {"train": [length] * n_train, "val": [length] * n_val},
                         {"train": [first] * n_train, "val": [first] * n_val})


def example_ids(batch) -> list[int]:
    """Which train example each row holds (-1: an empty row)."""
    return [int(x[0]) // 1000 - 1 if x[0] else -1 for x in batch.x]


def test_rows_are_right_padded_and_only_the_trained_targets_count(tmp_path):
    data = fake_examples(tmp_path / "ex", {"train": [4, 12, 9], "val": [5]}, {"train": [2, 3, 1], "val": [1]})
    loader = ExampleLoader(data, block_size=8, batch_size=3, device="cpu", seed=0)
    batch = loader._batch("train", [np.array([0]), np.array([1]), np.array([2])])
    assert batch.x.dtype == batch.y.dtype == torch.int64 and batch.x.shape == (3, 8)
    assert batch.x[0].tolist() == [1000, 1001, 1002, 0, 0, 0, 0, 0]  # 4 tokens: 3 inputs, then end-of-text padding
    assert batch.y[0].tolist() == [IGNORE, 1002, 1003, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]  # from position 2
    assert batch.x[1].tolist() == list(range(2000, 2008))  # 12 tokens: its first 9, truncated
    assert batch.y[1].tolist() == [IGNORE, IGNORE] + list(range(2003, 2009))
    assert batch.x[2].tolist() == list(range(3000, 3008)) and batch.y[2].tolist() == list(range(3001, 3009))
    assert loader.summary()["data/truncated_examples"] == 1


def test_overlong_examples_are_truncated_or_dropped_and_counted(tmp_path):
    # T + 1 = 9 tokens: [fits, too long but trained early, too long with its answer past the window, no answer]
    lengths, first = {"train": [6, 20, 20, 6, 7], "val": [5, 30]}, {"train": [3, 4, 12, 6, 2], "val": [1, 10]}
    data = fake_examples(tmp_path / "ex", lengths, first)
    counts = ExampleLoader(data, block_size=8, batch_size=1, device="cpu", seed=0).summary()
    assert counts == {"data/train_examples": 3, "data/val_examples": 1, "data/truncated_examples": 1,
                      "data/dropped_overlong_examples": 0, "data/dropped_untrained_examples": 3}
    counts = ExampleLoader(data, block_size=8, batch_size=1, device="cpu", seed=0, overlong="drop").summary()
    assert counts == {"data/train_examples": 2, "data/val_examples": 1, "data/truncated_examples": 0,
                      "data/dropped_overlong_examples": 3, "data/dropped_untrained_examples": 1}


def test_too_few_examples_for_a_batch_is_an_error_naming_the_keys(tmp_path):
    with pytest.raises(ValueError, match=r"12 train and 5 val examples are left .* a batch takes train\.batch_size "
                                         r"× world size = 16 .*lower train\.batch_size"):
        ExampleLoader(uniform(tmp_path), block_size=8, batch_size=8, device="cpu", seed=0, world_size=2)


def test_each_epoch_is_a_reproducible_shuffle_of_every_train_example(tmp_path):
    data = uniform(tmp_path)
    epochs = []
    for seed in (0, 0, 1):
        loader = ExampleLoader(data, block_size=8, batch_size=4, device="cpu", seed=seed)
        epochs.append([sum((example_ids(loader.next_batch()) for _ in range(3)), []) for _ in range(2)])
    assert epochs[0] == epochs[1]  # the same seed: the same order
    for order in epochs[0] + epochs[2]:
        assert sorted(order) == list(range(12))  # every example once per epoch
    assert epochs[0][0] != epochs[0][1] and epochs[0] != epochs[2]  # reshuffled each epoch; another seed differs
    assert loader.epoch_batches() == 3  # 12 examples in batches of 4: what train.epochs counts


def test_resuming_from_state_dict_mid_epoch_gives_the_same_batches(tmp_path):
    data = uniform(tmp_path, n_train=10)  # 10 examples, batches of 4: epochs end inside batches
    loader = ExampleLoader(data, block_size=8, batch_size=4, device="cpu", seed=3)
    for _ in range(4):
        loader.next_batch()
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 6
    expected = [loader.next_batch() for _ in range(5)]
    resumed = ExampleLoader(data, block_size=8, batch_size=4, device="cpu", seed=0)
    resumed.load_state_dict(state)
    for batch in expected:
        got = resumed.next_batch()
        assert torch.equal(got.x, batch.x) and torch.equal(got.y, batch.y)


def test_packed_rows_resume_mid_epoch_exactly_and_refuse_padded_state(tmp_path):
    data = fake_examples(tmp_path / "ex", {"train": [3, 7, 5, 9, 4, 6, 2, 8, 5, 3, 6], "val": [4, 5]},
                         {"train": [1] * 11, "val": [1, 1]})
    loader = ExampleLoader(data, block_size=8, batch_size=2, device="cpu", seed=3, packing=True)
    for _ in range(5):  # into the second epoch
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(4)]
    resumed = ExampleLoader(data, block_size=8, batch_size=2, device="cpu", seed=0, packing=True)
    resumed.load_state_dict(state)
    for batch in expected:
        got = resumed.next_batch()
        assert all(torch.equal(a, b) for a, b in ((got.x, batch.x), (got.y, batch.y), (got.positions, batch.positions)))
    padded = ExampleLoader(data, block_size=8, batch_size=2, device="cpu", seed=0)
    with pytest.raises(ValueError, match="the checkpoint read packed rows, this run data.packing=false"):
        padded.load_state_dict(state)


def test_best_fit_decreasing_puts_each_example_once_into_the_fullest_row_it_fits():
    sizes = np.array([5, 4, 3, 3, 2, 1, 8])
    rows = pack(np.arange(6), sizes, capacity=8)  # example 6 is not among the ids
    # 5 opens row 0 (3 free), 4 row 1 (4 free); the first 3 fills row 0, the second goes to row 1 (1 free);
    # 2 opens row 2, and 1 fills row 1, the fullest row it fits
    assert [row.tolist() for row in rows] == [[0, 2], [1, 3, 5], [4]]
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 9, size=200)
    rows = pack(rng.permutation(200), sizes, capacity=8)
    assert sorted(np.concatenate(rows).tolist()) == list(range(200))
    assert all(sizes[row].sum() <= 8 for row in rows)
    assert len(rows) <= math.ceil(11 / 9 * math.ceil(sizes.sum() / 8)) + 1  # BFD's bound: 11/9 OPT + 6/9


def test_packed_rows_restart_positions_at_each_example_and_train_only_its_answers(tmp_path):
    data = fake_examples(tmp_path / "ex", {"train": [4, 3, 6], "val": [5]}, {"train": [2, 1, 3], "val": [1]})
    loader = ExampleLoader(data, block_size=8, batch_size=1, device="cpu", seed=0, packing=True)
    # sizes 3, 2, 5 (n tokens: n - 1 inputs): 5 opens row 0, 3 fills it; 2 opens row 1
    assert [row.tolist() for row in loader._rows("train", loader.kept["train"])] == [[2, 0], [1]]
    batch = loader._batch("train", [np.array([2, 0]), np.array([1])])
    assert batch.x[0].tolist() == [3000, 3001, 3002, 3003, 3004, 1000, 1001, 1002]
    assert batch.y[0].tolist() == [IGNORE, IGNORE, 3003, 3004, 3005, IGNORE, 1002, 1003]
    assert batch.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.x[1].tolist() == [2000, 2001, 0, 0, 0, 0, 0, 0]  # padded after the example ...
    assert batch.y[1].tolist() == [2001, 2002] + [IGNORE] * 6
    assert batch.positions[1].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]  # ... the padding a row of its own
    summary = loader.summary()
    assert summary["data/train_rows"] == 2 and summary["data/packing_fill"] == 10 / 16
    assert loader.epoch_batches() == 2
    unpacked = ExampleLoader(data, block_size=8, batch_size=1, device="cpu", seed=0)
    assert unpacked.next_batch().positions is None and "data/packing_fill" not in unpacked.summary()


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_packed_and_padded_rows_give_the_same_val_loss(attention, tmp_path):
    lengths = [9, 3, 14, 6, 4, 11, 3, 7]
    data = fake_examples(tmp_path / "ex", {"train": [14] * 4, "val": lengths}, {"train": [1] * 4, "val": [2] * 8})
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=9000, attention=attention))
    model = model.double().eval()
    means = []
    for packing in (False, True):
        loader = ExampleLoader(data, block_size=16, batch_size=2, device="cpu", seed=0, vocab_size=9000,
                               packing=packing)
        total, count = 0.0, 0
        for batch in loader.eval_batches("val", 100):
            with torch.no_grad():
                logits, _ = model(batch.x, positions=batch.positions)
            trained = batch.y != IGNORE
            total += torch.nn.functional.cross_entropy(logits[trained], batch.y[trained], reduction="sum").item()
            count += int(trained.sum())
        means.append(total / count)
    assert count == sum(n - 1 - 1 for n in lengths)  # every val example's targets from position 2, once
    assert means[0] == pytest.approx(means[1], rel=1e-12)


def test_state_of_other_data_is_refused(tmp_path):
    loader = ExampleLoader(uniform(tmp_path), block_size=8, batch_size=4, device="cpu", seed=0)
    with pytest.raises(ValueError, match="the checkpoint read the prepared examples other-123"):
        loader.load_state_dict(loader.state_dict() | {"data": "other-123"})
    with pytest.raises(ValueError, match=r"the checkpoint's loader read token windows of text"):
        loader.load_state_dict({"seed": 0, "step": 3})


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_ranks_of_b_read_the_examples_of_one_rank_of_2b(tmp_path, packing):
    data = uniform(tmp_path, n_train=18, length=4, first=2) if packing else uniform(tmp_path, n_train=10)  # 9 rows
    single = ExampleLoader(data, block_size=8, batch_size=4, device="cpu", seed=5, packing=packing)
    ranks = [ExampleLoader(data, block_size=8, batch_size=2, device="cpu", seed=5, rank=r, world_size=2,
                           packing=packing) for r in range(2)]
    for _ in range(6):  # across epoch boundaries
        parts = [rank.next_batch() for rank in ranks]
        whole = single.next_batch()
        assert torch.equal(torch.cat([p.x for p in parts]), whole.x)
        assert torch.equal(torch.cat([p.y for p in parts]), whole.y)
        if packing:
            assert torch.equal(torch.cat([p.positions for p in parts]), whole.positions)
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    evals = [[example_ids(b) for b in rank.eval_batches("val", 20)] for rank in ranks]
    assert [a + b for a, b in zip(*evals, strict=True)] == [example_ids(b) for b in single.eval_batches("val", 20)]


def test_eval_reads_each_val_example_once(tmp_path):
    loader = ExampleLoader(uniform(tmp_path, n_val=5), block_size=8, batch_size=2, device="cpu", seed=0)
    batches = list(loader.eval_batches("val", 20))
    assert [example_ids(b) for b in batches] == [[0, 1], [2, 3], [4, -1]]  # fewer than 20: each once, then empty
    assert (batches[-1].y[1] == IGNORE).all()
    assert [example_ids(b) for b in loader.eval_batches("val", 2)] == [[0, 1], [2, 3]]
    assert [example_ids(b) for b in loader.eval_batches("val", 2)] == [[0, 1], [2, 3]]  # the same every time


@pytest.mark.parametrize("attention", ["naive", "sdpa", pytest.param("triton", marks=needs_triton)])
def test_padding_changes_no_logit_of_the_example_and_no_loss(attention, tmp_path):
    data = fake_examples(tmp_path / "ex", {"train": [9, 5], "val": [5]}, {"train": [3, 2], "val": [1]})
    loader = ExampleLoader(data, block_size=16, batch_size=2, device="cpu", seed=0, vocab_size=4096)
    batch = loader._batch("train", [np.array([0]), np.array([1])])
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=4096, attention=attention)).eval()
    with torch.no_grad():
        logits, loss = model(batch.x, batch.y)
        alone, _ = model(batch.x[1:, :4])  # example 1 unpadded: its 4 inputs
    torch.testing.assert_close(logits[1, :4], alone[0], rtol=0, atol=1e-5)
    trained = batch.y != IGNORE
    assert trained.sum() == 6 + 3  # example 0: the targets of positions 3..8; example 1: of 2..4
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[trained], batch.y[trained]))


# --- a fine-tuning run --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """A random transformers Llama whose tokenizer has a ChatML chat template, as SmolLM2-Instruct, in miniature."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = make_tokenizer(tmp_path_factory.mktemp("chat_model"), CHATML, eos_token="<|im_end|>")
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_chat_fine_tuning_trains_evaluates_and_resumes_exactly(chat_model_dir, tmp_path):
    from training.loop import train

    colours = ["black", "white", "red", "green"]
    rows = [{"messages": [{"role": "user", "content": f"the {c} cat"}, {"role": "assistant", "content": f"sat {i}"}]}
            for i in range(12) for c in colours]
    write_jsonl(tmp_path / "chats.jsonl", rows)

    def run(name: str, *more: str) -> dict:
        overrides = [f"init_from={chat_model_dir}", "data=chat_local", f"data.data_files=[{tmp_path / 'chats.jsonl'}]",
                     f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.25", "model.block_size=48",
                     "train.batch_size=4", "train.eval_batches=2", "train.eval_interval=2", "train.warmup_steps=1",
                     "train.lr_decay_steps=4", "train.learning_rate=3e-3", "train.perf_warmup_steps=2",
                     "train.log_interval=1", "wandb.mode=disabled", "train.device=cpu", *more]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            cfg = OmegaConf.to_object(compose("config", overrides=overrides))
        summary = train(cfg, tmp_path / name, root=tmp_path)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return summary | {"losses": {m["step"]: m["train/loss"] for m in map(json.loads, lines) if "train/loss" in m}}

    full = run("full", "train.max_steps=4")
    assert math.isfinite(full["final/val_loss"]) and full["losses"][4] < full["losses"][1]
    assert (full["data/train_examples"], full["data/val_examples"], full["data/truncated_examples"]) == (36, 12, 0)
    # the answers alone are trained on: a fraction of the padded rows' positions
    assert 0 < full["perf/trained_tokens_per_sec_median"] < full["perf/tokens_per_sec_median"] / 2
    run("first", "train.max_steps=2")
    resumed = run("second", "train.max_steps=4", f"train.resume={tmp_path / 'first'}")
    assert resumed["losses"] == {s: full["losses"][s] for s in (3, 4)}
    assert resumed["final/val_loss"] == full["final/val_loss"]
