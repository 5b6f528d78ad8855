"""Instruction and chat data for supervised fine-tuning: rows -> conversations -> the model's chat template -> tokens
with a loss mask, cached in <cache_dir>/<name>-<hash>/: {train,val}.bin (tokens), .mask (1: a trained token), .index
(each example's length and first trained position) and meta.json.

    data = prepare_dataset(DataConfig(format="chat", source="files", data_files=["chats.jsonl"],
                                      encoding="/models/SmolLM2-135M-Instruct"))   # data/prepare.py hands it here
    loader = ExampleLoader(data, block_size=1024, batch_size=8, device="cuda", seed=0)  # data/loader.py

Two shapes of rows (data.format): `chat`, a column of conversations (data.messages_column), each a list of
{role, content} messages with the roles system, user and assistant, any number of turns; `instruction`, Alpaca's
columns (data.instruction_column, input_column, output_column): the instruction, and its input after a blank line,
is the user's turn, the output the assistant's. data.system_prompt is the system message of every conversation that
has none.

A conversation is rendered by transformers' apply_chat_template, with the model's own template (what transformers
reads from the tokenizer_config.json or chat_template.jinja beside its tokenizer.json) or, named by
data.prompt_template, a plain template of PROMPT_TEMPLATES, and tokenized once, as apply_chat_template(tokenize=True)
does. The loss mask (data.train_on=assistant) covers each assistant turn: from the end of the conversation rendered
up to that turn with the generation prompt (add_generation_prompt=True) to the end of the conversation rendered up
to and including it, less trailing whitespace: the answer and the template's end-of-turn token (<|im_end|>,
<|eot_id|>, an end-of-text), never a role header. A token is trained if its characters (the tokenizer's offsets)
overlap such a span. This needs a template that renders a conversation's beginning alike whether or not more turns
follow; one that does not is an error naming the fix.

A bad row (a missing column, an unknown role, no assistant turn, a template that fails) is one ValueError naming the
file, row and column and the fix, raised before anything is written; the folder appears only once the examples are
tokenized, its files are written atomically and meta.json, last, marks it complete. Examples are cached whole: the
loader truncates or drops those longer than model.block_size + 1 tokens (data.overlong), and counts them.
"""

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from data.config import DataConfig, DataFormat, TrainOn
from data.prepare import (
    SPLIT_SEED,
    PreparedData,
    file_stamps,
    load_rows,
    local_files,
    write_atomic,
    write_tokens,
)
from data.tokenizers import _read_json, byte_tokenizer, get_encoding, tokenizer_file

SFT_VERSION = 1  # bump when a change here changes the files, so old cache folders are not reused
ROLES = ("system", "user", "assistant")
ALPACA_PREAMBLE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.")
# data.prompt_template: Jinja chat templates, rendered as a model's own, for a model without one. Each ends an answer
# with eos_token, the text of the encoding's end-of-text token (ChatML with its <|im_end|>).
PROMPT_TEMPLATES = {
    # Stanford Alpaca's prompt; a system message takes the place of its preamble
    "alpaca": (
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}"
        "{% if loop.first %}{{ '" + ALPACA_PREAMBLE + "\\n\\n' }}{% endif %}"
        "{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
        "{% else %}{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}
# Beside a tokenizer.json: what transformers reads to render (its template, special tokens), and the end-of-text token
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json", "special_tokens_map.json",
                  "config.json")


@dataclass
class Examples:
    """One split's examples: example i is tokens[starts[i] : starts[i] + lengths[i]], and mask[j] = 1 where token j
    is trained (the target of the position before it); first[i] is example i's first trained position (>= 1: the
    first token has no position before it), or its length if none."""

    tokens: np.memmap
    mask: np.memmap
    lengths: np.ndarray
    first: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths


@dataclass
class PreparedExamples(PreparedData):
    """PreparedData's token files (n_train, n_val: tokens), with each example's mask and extent beside them."""

    train_examples: int
    val_examples: int

    def examples(self, split: str) -> Examples:
        n_tokens, n = {"train": (self.n_train, self.train_examples), "val": (self.n_val, self.val_examples)}[split]
        index = self._mapped(f"{split}.index", np.int64, (n, 2))
        return Examples(tokens=self._mapped(f"{split}.bin", self.dtype, (n_tokens,)),
                        mask=self._mapped(f"{split}.mask", np.uint8, (n_tokens,)), lengths=index[:, 0],
                        first=index[:, 1])

    def _mapped(self, name: str, dtype: Any, shape: tuple[int, ...]) -> np.memmap:
        path = self.dir / name
        expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
        size = path.stat().st_size if path.exists() else None
        if size != expected:
            found = "is missing" if size is None else f"has {size} bytes"
            raise ValueError(f"{path} {found}, but meta.json says {expected} bytes: the cache is damaged; delete the "
                             f"folder {self.dir} to re-prepare it")
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class ChatTemplate:
    """Renders conversations with one template and tokenizes them with one tokenizer, as apply_chat_template does."""

    def __init__(self, encoding: str, prompt_template: str | None):
        from transformers import PreTrainedTokenizerFast  # seconds to import: only when examples are prepared

        enc, path = get_encoding(encoding), tokenizer_file(encoding)
        if path is not None:  # transformers reads the template and special tokens beside the tokenizer.json
            self.tokenizer = PreTrainedTokenizerFast.from_pretrained(path.parent, tokenizer_file=str(path))
            self.tiktoken = None
        else:
            # a tiktoken encoding (bytes, gpt2) has no transformers tokenizer: this one only renders (the named
            # templates read no special token but eos_token, passed below), and tiktoken tokenizes
            self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer())
            self.tiktoken = enc
        if prompt_template is None and self.tokenizer.chat_template is None:
            where = (f"no chat_template in {path.parent / 'tokenizer_config.json'} and no chat_template.jinja beside "
                     "it" if path is not None else f"data.encoding={encoding} is not a model's tokenizer")
            raise NoChatTemplateError(
                f"the tokenizer of data.encoding={encoding} has no chat template ({where}): name a plain prompt "
                f"template, data.prompt_template={'|'.join(PROMPT_TEMPLATES)}, or fine-tune a model that has a chat "
                "template (an instruct model)")
        self.template = PROMPT_TEMPLATES[prompt_template] if prompt_template is not None else None  # None: its own
        self.kwargs = {} if self.template is None else {"eos_token": enc.decode([enc.eot_token])}
        self.folder = path.parent if path is not None else None  # the model's files beside its tokenizer.json
        # the end-of-text tokens; the byte tokenizer that renders for tiktoken has none, and ids that are not ours
        own = self.tokenizer.eos_token_id if self.tiktoken is None else None
        self.eos = [t for t in (enc.eot_token, own) if t is not None]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    def generation_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids the assistant's next turn follows: the conversation rendered with the generation prompt,
        tokenized as the examples are."""
        return self.encode([self.render(messages, add_generation_prompt=True)])[0][0]

    def end_of_turn(self) -> list[int]:
        """The tokens that end an assistant's turn, for generation to stop at: the one the template closes the turn
        with (what follows the answer, less whitespace), the tokenizer's end-of-text token and the eos_token_id(s)
        of the generation_config.json and config.json beside it (Llama 3 lists several there). ValueError for a
        template that closes the turn with the text of several tokens (chatml's <|im_end|> where it is no special
        token): generation stops at single tokens."""
        probe = "ANSWER"
        turn = self.render([{"role": "user", "content": "QUESTION"}, {"role": "assistant", "content": probe}])
        _, found, after = turn.rpartition(probe)
        closing = after.strip() if found else ""  # "": a template that closes no turn, or rewrites the answer
        ids = self.encode([closing])[0][0] if closing else []
        if len(ids) > 1:
            raise ValueError(f"the chat template closes an assistant turn with {closing!r}, which this tokenizer "
                             f"reads as {len(ids)} tokens, not as one that generation can stop at: use a template "
                             "that closes it with the end-of-text token (alpaca)")
        stops = ids + self.eos
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(self.folder / name).get("eos_token_id") if self.folder is not None else None
            stops += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        return sorted(set(stops))

    def text_and_spans(self, messages: list[dict[str, str]], train_on: TrainOn) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans to train on (module docstring); raises _NotAPrefix for
        a template that renders a conversation's beginning differently once more turns follow."""
        text = self.render(messages)
        if train_on == TrainOn.all:
            return text, [(0, len(text))]
        spans = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = self.render(messages[:i], add_generation_prompt=True)
                turn = self.render(messages[: i + 1])
                if not (turn.startswith(prompt) and text.startswith(turn)):
                    raise _NotAPrefix
                spans.append((len(prompt), max(len(prompt), len(turn.rstrip()))))  # not the newline after <|im_end|>
        return text, spans

    def encode(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's token ids (special-token text read as the special token, none added) and character offsets."""
        if self.tiktoken is None:
            out = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            return list(zip(out["input_ids"], out["offset_mapping"], strict=True))
        encoded = []
        for text in texts:
            ids = self.tiktoken.encode(text, allowed_special="all")
            _, starts = self.tiktoken.decode_with_offsets(ids)
            encoded.append((ids, list(zip(starts, [*starts[1:], len(text)], strict=True))))
        return encoded


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template, and no plain template is named."""


class _NotAPrefix(Exception):
    """The template renders a conversation's beginning differently once more turns follow."""


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span. A token without characters of its own (offsets trimmed, or
    a byte inside a character) counts as the character where it starts."""
    return [int(any(s < end and max(e, s + 1) > start for start, end in spans)) for s, e in offsets]


def prepare_examples(cfg: DataConfig, root: Path) -> PreparedExamples:
    """Prepare (or reuse) the examples of `cfg` (data.format=instruction|chat); data/prepare.py's prepare_dataset
    calls it with data.encoding resolved and relative paths resolved against `root`."""
    fmt = DataFormat(cfg.format)
    if cfg.source not in ("hub", "files"):
        raise ValueError(f"data.format={fmt.value} reads the rows of a hub dataset or of data files, not "
                         f"data.source={cfg.source}: set data.source=hub and data.path=<dataset id>, or "
                         "data.source=files and data.data_files=[path/to/file.jsonl] (json, jsonl, parquet, csv)")
    if cfg.prompt_template is not None and cfg.prompt_template not in PROMPT_TEMPLATES:
        raise ValueError(f"data.prompt_template={cfg.prompt_template!r}: use one of {', '.join(PROMPT_TEMPLATES)}, "
                         "or null for the model's own chat template")
    files = local_files(cfg, root) if cfg.source == "files" else []
    settings = _settings(cfg, files)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    cache = root / cfg.cache_dir
    folder = cache / f"{cfg.name}-{key}"
    if (folder / "meta.json").exists():
        return PreparedExamples.load(folder)

    chat = ChatTemplate(cfg.encoding, cfg.prompt_template)  # a missing template fails before a long download
    enc = get_encoding(cfg.encoding)
    dtype = np.uint16 if enc.n_vocab <= 2**16 else np.uint32
    cache.mkdir(parents=True, exist_ok=True)
    # datasets' arrow copies only serve the preparation: a scratch folder beside the cache folder, deleted at the end
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{folder.name}-") as scratch:
        rows, origins = load_rows(cfg, files, scratch)
        if cfg.max_documents is not None:
            rows = rows.select(range(min(cfg.max_documents, len(rows))))
        _check_columns(cfg, rows.column_names, origins)
        examples = rows.map(
            _tokenize_rows,
            batched=True,
            with_indices=True,
            fn_kwargs={"cfg": cfg, "chat": chat, "origins": origins},
            remove_columns=rows.column_names,
            features=datasets.Features({"ids": datasets.List(datasets.Value(np.dtype(dtype).name)),
                                        "mask": datasets.List(datasets.Value("uint8")),
                                        "length": datasets.Value("int64"), "first": datasets.Value("int64")}),
            num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
            desc=f"tokenizing {cfg.name} ({fmt.value})",
        )
        n = len(examples)
        if n < 2:
            raise ValueError(f"{cfg.name}: {n} examples, but train and val need one each: give more rows "
                             "(data.data_files, data.max_documents)")
        n_val = min(max(1, round(cfg.val_fraction * n)), n - 1)  # at least one example each
        if cfg.val_split == "tail":
            splits = {"train": examples.select(range(n - n_val)), "val": examples.select(range(n - n_val, n))}
        else:
            split = examples.train_test_split(test_size=n_val, seed=SPLIT_SEED)
            splits = {"train": split["train"], "val": split["test"]}
        folder.mkdir(exist_ok=True)
        meta: dict[str, Any] = {"encoding": cfg.encoding, "vocab_size": enc.n_vocab, "eot_token": enc.eot_token,
                                "dtype": np.dtype(dtype).name, "max_token_id": 0, "format": fmt.value}
        for name, part in splits.items():
            meta[f"n_{name}"], max_id = write_tokens(part, folder / f"{name}.bin", dtype)
            write_tokens(part, folder / f"{name}.mask", np.uint8, column="mask")
            columns = part.select_columns(["length", "first"]).with_format("numpy")
            write_atomic(folder / f"{name}.index", np.stack([columns["length"], columns["first"]], axis=1))
            meta[f"{name}_examples"], meta["max_token_id"] = len(part), max(meta["max_token_id"], max_id)
    meta["settings"] = settings
    write_atomic(folder / "meta.json", json.dumps(meta, indent=2).encode())  # last: it marks the folder complete
    return PreparedExamples.load(folder)


def _settings(cfg: DataConfig, files: list[str]) -> dict[str, Any]:
    """Everything that changes the examples' files; the cache folder's name hashes it. data.overlong and
    data.packing are the loader's."""
    settings = {k: v.value if isinstance(v, Enum) else v for k, v in asdict(cfg).items()
                if k not in ("name", "num_proc", "cache_dir", "text_column", "overlong", "packing")}
    settings["sft_version"] = SFT_VERSION
    settings["files"] = file_stamps(files)
    path = tokenizer_file(cfg.encoding)
    if path is not None:  # the tokenizer and what renders with it can change under the same path
        side = [path.parent / name for name in TEMPLATE_FILES]
        settings["tokenizer"] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in [path, *side]
                                 if f.is_file()}
    if cfg.prompt_template is not None:
        settings["template"] = PROMPT_TEMPLATES[cfg.prompt_template]
    return settings


def _check_columns(cfg: DataConfig, columns: list[str], origins: list[tuple[str, int]]) -> None:
    """The columns that data.format reads are there; if not, the error names the keys, and the format that fits."""
    shapes = {DataFormat.chat: ([cfg.messages_column], "conversations", "data.messages_column"),
              DataFormat.instruction: ([cfg.instruction_column, cfg.output_column], "instructions and their answers",
                                       "data.instruction_column and data.output_column")}
    fmt = DataFormat(cfg.format)
    needed, what, keys = shapes[fmt]
    missing = [c for c in needed if c not in columns]
    if not missing:
        return
    other = DataFormat.instruction if fmt == DataFormat.chat else DataFormat.chat
    fits = all(c in columns for c in shapes[other][0])
    raise ValueError(f"{', '.join(name for name, _ in origins)} has no column {' or '.join(map(repr, missing))} "
                     f"(its columns: {columns}), where data.format={fmt.value} reads {what}: "
                     + (f"these are {shapes[other][1]}: set data.format={other.value}" if fits else
                        f"set {keys} to the columns that hold them"))


def _tokenize_rows(batch: dict[str, list], indices: list[int], cfg: DataConfig, chat: ChatTemplate,
                   origins: list[tuple[str, int]]) -> dict[str, list]:
    rendered = []
    for values, index in zip(zip(*batch.values(), strict=True), indices, strict=True):
        where = _where(origins, index)
        messages = _conversation(dict(zip(batch, values, strict=True)), cfg, where)
        try:
            rendered.append(chat.text_and_spans(messages, TrainOn(cfg.train_on)))
        except _NotAPrefix:
            raise ValueError(
                f"{where}: the chat template renders the beginning of the conversation differently once later turns "
                "follow (it rewrites or drops earlier turns), so the assistant's tokens cannot be told from the "
                "prompt's: train on every token with data.train_on=all, or render with a plain template, "
                f"data.prompt_template={'|'.join(PROMPT_TEMPLATES)}") from None
        except Exception as err:  # jinja2's TemplateError (raise_exception), or any error of the template's code
            raise ValueError(f"{where}: the chat template failed to render the conversation ({type(err).__name__}: "
                             f"{err}): fix the row (or remove it), or render with another template, "
                             f"data.prompt_template={'|'.join(PROMPT_TEMPLATES)}") from err
    out: dict[str, list] = {"ids": [], "mask": [], "length": [], "first": []}
    for (ids, offsets), (_, spans) in zip(chat.encode([text for text, _ in rendered]), rendered, strict=True):
        mask = token_mask(offsets, spans)
        out["ids"].append(ids)
        out["mask"].append(mask)
        out["length"].append(len(ids))
        out["first"].append(next((p for p in range(1, len(ids)) if mask[p]), len(ids)))
    return out


def _where(origins: list[tuple[str, int]], index: int) -> str:
    """How errors name row `index` of the concatenated rows: its file (or dataset) and its row there, from 0."""
    name, start = next((name, start) for name, start in reversed(origins) if start <= index)
    return f"{name}, row {index - start}"


def _conversation(row: dict[str, Any], cfg: DataConfig, where: str) -> list[dict[str, str]]:
    """The row as messages [{role, content}, ...], data.system_prompt first where the row has no system message."""
    if DataFormat(cfg.format) == DataFormat.chat:
        column = cfg.messages_column
        messages = row[column]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}, column {column!r}: a conversation is a list of {{role, content}} messages, "
                             f"not {_show(messages)}: fix the row, or set data.messages_column to the column that "
                             "holds them")
        out = []
        for j, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}, column {column!r}: message {j} is {_show(message)}, not a {{role, "
                                 "content} pair of strings: give every message a role and a text content")
            if message["role"] not in ROLES:
                raise ValueError(f"{where}, column {column!r}: message {j} has the role {message['role']!r}, but "
                                 f"the roles are {', '.join(ROLES)}: rename it (ShareGPT's human and gpt are user "
                                 "and assistant), or remove the row")
            out.append({"role": message["role"], "content": message["content"]})
        if not any(m["role"] == "assistant" for m in out):
            raise ValueError(f"{where}, column {column!r}: the conversation has no assistant turn, so it has nothing "
                             "to train on: add the assistant's answer, or remove the row")
    else:
        instruction = _text(row, cfg.instruction_column, where)
        answer = _text(row, cfg.output_column, where)
        extra = _text(row, cfg.input_column, where, optional=True) if cfg.input_column in row else ""
        out = [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction},
               {"role": "assistant", "content": answer}]
    if cfg.system_prompt is not None and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": cfg.system_prompt})
    return out


def _text(row: dict[str, Any], column: str, where: str, optional: bool = False) -> str:
    """An instruction column's text: numbers as written (a csv column of answers may read as numbers)."""
    value = row[column]
    if value is None and optional:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{where}, column {column!r}: expected text, found {_show(value)}: fix the row, or remove it")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
