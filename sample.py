"""Sample text from one of our checkpoints or a Hugging Face model, streaming tokens to stdout as they are produced.

    python sample.py --init-from outputs/2026-11-29/12-00-00        # a run dir (its best, else last) or a checkpoint
    python sample.py --init-from gpt2 --prompt "Hello, I'm a language model," --num-samples 3 --max-new-tokens 100
    python sample.py --init-from HuggingFaceTB/SmolLM2-135M --prompt "Gravity is" --temperature 0.7 --top-p 0.9
    python sample.py --init-from path/to/hf-dir --prompt-file prompt.txt --temperature 0.8 --top-p 0.95 --seed 7
    python sample.py --init-from gpt2 --temperature 0 --prompt "The capital of France is"          # greedy
    python sample.py --init-from gpt2 --prompt "Once upon a time" --prompt "In 1905," --num-samples 4  # 8 rows
    python sample.py --init-from outputs/<lora run> --merge            # a LoRA run: its base + adapters, merged
    python sample.py --init-from HuggingFaceTB/SmolLM2-135M --adapter path/to/adapter   # a PEFT adapter directory
    python sample.py --init-from path/to/adapter                # on the base its adapter_config.json names
    python sample.py --init-from HuggingFaceTB/SmolLM2-135M-Instruct --chat          # a conversation, in a terminal
    python sample.py --init-from path/to/instruct-dir --chat --system "Be brief." --prompt "Capital of France?"

The tokenizer defaults to the one the model was trained with: our checkpoint's data.encoding, the one the config.json
of our export records (scripts/export_hf.py), gpt2 for a Hugging Face GPT-2, a Llama-family model's own
tokenizer.json. An empty prompt starts from the end-of-text token (or the tokenizer's BOS where it adds one). Every
prompt (--prompt may be given several times) times --num-samples makes one row of a single batch, generated together;
one row streams as it is produced, several are printed when done.
LoRA: a LoRA run's checkpoint (its adapters alone) generates from its base (the run's init_from) with the adapters
beside the weights, or folded into them with --merge (the same tokens). --adapter adds a PEFT adapter directory (ours,
scripts/export_hf.py --adapter, or one PEFT wrote) to the model --init-from names; an adapter directory as --init-from
goes on the base its adapter_config.json names (base_model_name_or_path). The tokenizer is the adapter directory's
tokenizer.json where it holds one, else its base's.
Generation uses a static KV cache (model/generate.py): the prompts are prefilled once, then each token attends to its
row's cache, on a GPU in a replayed CUDA graph (--compile fuses its kernels first: faster steps, a slower start). A
prompt longer than block_size keeps its last block_size tokens, and a context that outgrows block_size slides (each
step then re-runs the last block_size tokens); --no-cache gives the same tokens, slower. --attention takes any
backend of model/attention.py; with triton the prefill runs on our FlashAttention kernel and the decode steps on our
decode kernel. SDPA picks its own kernel here, even for a checkpoint trained with one pinned
(attention.sdpa_backend): the pinned kernel may not exist on the machine that samples.

Chat (--chat): each prompt is a user's message (--system: a system message before it), rendered with the model's
chat template (or a plain one, --chat-template alpaca|chatml) and its generation prompt; the answer is printed up to
the template's end-of-turn token (data/sft.py: ChatTemplate.end_of_turn), where generation stops. --prompt and
--prompt-file answer once, --num-samples answers per message in one batch; without them a stdin that is not a
terminal is the message, and in a terminal the conversation goes on line by line, each answer an assistant turn of
it, until an empty line or the end of input (one answer per turn: --num-samples 1).

A bad argument is a usage error (exit status 2, `sample.py: error: ...` naming the flag): a count below 1, a sampling
setting out of range, a missing prompt file, a device that is not there, the triton backend off a GPU or a tokenizer
that does not exist, or an --adapter that is no adapter directory we read, found before the model loads; a model that
cannot be found or read (a corrupt checkpoint, a run directory without one, a LoRA run's base that is not here), an
adapter that does not fit it, or a tokenizer that does not fit it, once it does; so is a model without a chat template
under --chat when --chat-template names none.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import tiktoken
import torch

from data import DataUnavailableError, Encoding, get_encoding, stream_decoder
from data.tokenizers import tokenizer_file
from kernels import env
from model import GPT, GPTConfig
from model.attention import BACKENDS
from model.generate import stream
from model.lora import LoRAError, adapter_base, adapter_encoding, is_adapter_dir, load_adapter, merge_lora, read_adapter
from model.pretrained import GPT2_REPOS, PretrainedError, pretrained_encoding, resolve
from training.checkpoint import load_checkpoint
from training.device import DTYPES, resolve_device, resolve_dtype
from training.init import checkpoint_model, is_run_dir
from training.resume import CheckpointError, find_checkpoint

if TYPE_CHECKING:
    from data.sft import ChatTemplate  # imported when --chat needs it: datasets' import costs a second

    Chat = tuple[ChatTemplate, list[int]]  # a chat template and the tokens that end the assistant's turn

# The loaders sample.py shares with train.py word their errors for train.py's config keys (init_from=,
# data.encoding=): sample.py checks its own arguments first, so that a mistake names the flag to change.
TOKENIZERS = (f"bytes, a tiktoken encoding ({', '.join(tiktoken.list_encoding_names())}), a tokenizer.json or a "
              "model directory holding one")


class UsageError(Exception):
    """A bad argument found only once the model is known: reported as argparse reports the others."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def sampling_temperature(text: str) -> float:
    """argparse type: a finite float >= 0 (0: greedy)."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text}")
    return value


def probability(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def encoding_name(text: str) -> str:
    """argparse type: a tokenizer that exists (whether its file parses is found when it loads)."""
    try:
        tokenizer_file(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no tokenizer here: use {TOKENIZERS}") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--init-from", required=True,
                   help="our checkpoint (.pt or run dir, a LoRA run's too), a GPT-2 name (gpt2, gpt2-medium, "
                        "gpt2-large, gpt2-xl), a Hugging Face hub id (owner/name), a local Hugging Face model dir "
                        "(config.json + safetensors) or a PEFT adapter dir (on the base its adapter_config.json names)")
    p.add_argument("--adapter", default=None,
                   help="a PEFT adapter dir (adapter_config.json + adapter_model.safetensors) added to the model "
                        "--init-from names")
    p.add_argument("--merge", action="store_true",
                   help="fold the adapters (a LoRA run's, --adapter's) into the weights before generating")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append",
                        help="prompt text, may be repeated (one batch); empty: start from the end-of-text token (or "
                             "the BOS the tokenizer adds)")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=sampling_temperature, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=probability, default=None,
                   help="sample among the most likely tokens covering p, in (0, 1]")
    p.add_argument("--seed", type=int, default=1337, help="seeds torch's RNG once, before the first sample")
    p.add_argument("--num-samples", type=positive_int, default=1,
                   help="samples of each prompt, generated together in one batch")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 on a GPU that has it, "
                   "else fp16 on CUDA, fp32 on CPU")
    p.add_argument("--attention", choices=list(BACKENDS), default=None,
                   help="attention backend; default: the checkpoint's (ours) or sdpa")
    p.add_argument("--encoding", type=encoding_name, default=None,
                   help="tokenizer: bytes, gpt2, a tokenizer.json or model dir; default: the model's own")
    p.add_argument("--no-cache", action="store_true", help="re-run the whole context for every token")
    p.add_argument("--compile", action="store_true",
                   help="fuse the decode step with torch.compile before capturing it (GPU; faster steps, slower start)")
    p.add_argument("--chat", action="store_true",
                   help="answer as the assistant: each prompt is a user's message, rendered with the chat template and "
                        "its generation prompt, answered up to its end-of-turn token; without --prompt: a "
                        "conversation in a terminal, else stdin is the message")
    p.add_argument("--system", default=None, help="with --chat: the system message")
    p.add_argument("--chat-template", default=None,
                   help="with --chat: a plain template, alpaca or chatml (data.prompt_template's), in place of the "
                        "model's own; needed for a model without one")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """What parsing cannot check by itself, before any model loads (no network either): exits with usage on a
    mistake. args.device becomes the torch.device it names."""
    if args.prompt_file is not None and args.prompt_file.is_dir():
        p.error(f"argument --prompt-file: {args.prompt_file} is a directory: name a text file")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        p.error(f"argument --prompt-file: no such file: {args.prompt_file}")
    if args.adapter is not None:
        try:  # its files and settings, before the base model loads (its tensors are small)
            read_adapter(args.adapter)
        except LoRAError as e:
            p.error(f"argument --adapter: {e}")
    check_chat_args(p, args)
    try:
        args.device = resolve_device(args.device, key="--device")  # its messages name the flag they are given
        if args.attention is not None:
            check_attention(args.attention, args.device, given=True)
    except (ValueError, RuntimeError, UsageError) as e:
        p.error(str(e))
    return args


def check_chat_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The chat flags; a stdin that is no terminal becomes --chat's one message (args.prompt)."""
    for flag, value in (("--system", args.system), ("--chat-template", args.chat_template)):
        if value is not None and not args.chat:
            p.error(f"argument {flag}: only with --chat")
    if args.chat_template is not None:
        from data.sft import PROMPT_TEMPLATES

        if args.chat_template not in PROMPT_TEMPLATES:
            p.error(f"argument --chat-template: {args.chat_template!r} is no plain template: use one of "
                    f"{', '.join(PROMPT_TEMPLATES)}")
    if not args.chat or args.prompt is not None or args.prompt_file is not None:
        return
    if not sys.stdin.isatty():
        args.prompt = [sys.stdin.read()]
        if not args.prompt[0].strip():
            p.error("argument --prompt: --chat read no message from stdin (not a terminal): give --prompt or "
                    "--prompt-file, pipe the message in, or run in a terminal to converse")
    elif args.num_samples > 1:
        p.error("argument --num-samples: a conversation in the terminal has one answer per turn: --num-samples 1, "
                "or several answers to one message with --prompt")


def check_attention(attention: str, device: torch.device, given: bool) -> None:
    """UsageError for the triton backend off a GPU: our kernels run on CPU tensors only through Triton's interpreter
    (TRITON_INTERPRET=1)."""
    if attention == "triton" and device.type != "cuda" and not env.INTERPRET:
        whose = "triton" if given else "the checkpoint's backend, triton,"
        raise UsageError(f"argument --attention: {whose} runs our kernels on a CUDA GPU, not on {device} (there only "
                         "under TRITON_INTERPRET=1, slowly): use --attention sdpa, or --device cuda")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    return check_args(p, p.parse_args(argv))


def our_checkpoint(init_from: str) -> Path | None:
    """The checkpoint init_from means, if it is ours: a .pt file or .dcp directory, or a run dir's best (else last)."""
    return find_checkpoint(init_from, names=("best", "last"))


def load_model(init_from: str, attention: str | None, encoding: str | None, adapter: str | None = None,
               merge: bool = False) -> tuple[GPT, str]:
    """The model (dropout off) and its encoding: `encoding`, else the one it was trained with (with an adapter: its
    directory's tokenizer.json, else its base's). adapter: an adapter directory added to the model init_from names
    (merged first if it has adapters of its own); an adapter directory as init_from goes on the base it names.
    merge: every adapter folded into the weights."""
    if adapter is not None:  # on the model init_from names, its own adapters merged: one set at a time
        model, encoding = load_model(init_from, attention, encoding or adapter_encoding(adapter), merge=True)
        add_adapter(model, adapter, "--adapter")
    elif is_adapter_dir(init_from):
        base = adapter_base_of(init_from)
        try:
            model, encoding = load_model(base, attention, encoding or adapter_encoding(init_from), merge=True)
        except UsageError as e:  # the base is named in the adapter's config, not on the command line
            raise UsageError(f"{e} (the base model that {init_from}'s adapter_config.json names: pass the base as "
                             f"--init-from and the adapter as --adapter {init_from})") from None
        add_adapter(model, init_from, "--init-from")
    else:
        model, encoding = load_named(init_from, attention, encoding)
    if merge:
        merge_lora(model)
    return model, encoding


def adapter_base_of(adapter_dir: str) -> str:
    """The base model an adapter directory given as --init-from names; UsageError where it names none."""
    try:
        base = adapter_base(adapter_dir)
    except LoRAError as e:
        raise UsageError(f"argument --init-from: {e}") from None
    if base is None:
        raise UsageError(f"argument --init-from: {adapter_dir}'s adapter_config.json names no base model "
                         f"(base_model_name_or_path): pass the base as --init-from and the adapter as --adapter "
                         f"{adapter_dir}")
    return base


def add_adapter(model: GPT, adapter_dir: str, flag: str) -> None:
    """The adapters of adapter_dir on model; UsageError naming flag for an adapter of another model."""
    try:
        load_adapter(model, adapter_dir)
    except LoRAError as e:
        raise UsageError(f"argument {flag}: {e}") from None


def load_named(init_from: str, attention: str | None, encoding: str | None) -> tuple[GPT, str]:
    """The model of our checkpoint (a LoRA run's: its base with its adapters, unmerged) or of a Hugging Face model,
    dropout off, and its encoding: `encoding`, else the one it was trained with."""
    checkpoint = our_checkpoint(init_from)
    if checkpoint is None:
        if is_run_dir(init_from):
            raise UsageError(f"argument --init-from: {init_from} is a run directory without checkpoints (no "
                             "checkpoints/best or last .pt or .dcp): give a run that saved one, or a checkpoint")
        try:  # a local directory, or the snapshot of a GPT-2 name or hub id (downloaded once)
            model_dir = resolve(init_from)
        except ValueError:  # none of those; resolve's message speaks of train.py's init_from
            raise UsageError(f"argument --init-from: {init_from!r} is no file or directory here, nor a GPT-2 name "
                             f"({', '.join(GPT2_REPOS)}) or a Hugging Face hub id (owner/name)") from None
        except PretrainedError as e:  # a directory that is no model, an unreachable hub
            raise UsageError(f"argument --init-from: {e}") from None
        try:
            model = GPT.from_pretrained(str(model_dir), **({"attention": attention} if attention else {}))
            return model, encoding or pretrained_encoding(model_dir)
        except PretrainedError as e:  # an architecture or weights that are not ours, no tokenizer
            raise UsageError(f"argument --init-from: {e}") from None
    try:
        state = load_checkpoint(checkpoint, tensors=False, verify=False)  # its config: checkpoint_model checks it
        # SDPA picks its own kernel: one pinned for training (attention.sdpa_backend) may not run where this samples.
        overrides = {"dropout": 0.0, "sdpa_backend": "auto", **({"attention": attention} if attention else {})}
        model = checkpoint_model(checkpoint, GPTConfig(**{**state["model_config"], **overrides}))
    except CheckpointError as e:  # truncated, empty, not ours (a bare state dict), adapters on another base
        raise UsageError(f"argument --init-from: {e}") from None
    except (PretrainedError, ValueError) as e:  # a LoRA run's base (its init_from) that does not load here
        if "base" not in state:
            raise
        raise UsageError(f"argument --init-from: {checkpoint} holds adapters on init_from={state['base']['init_from']}"
                         f", which does not load here: {e}") from None
    return model, encoding or state["config"]["data"]["encoding"]


def prepare(args: argparse.Namespace) -> tuple[GPT, Encoding, Chat | None]:
    """The model on its device, its tokenizer and (--chat) the chat template that renders for it with the tokens that
    end a turn; UsageError for a model that cannot be found, a tokenizer that is missing, or a model without a chat
    template and none named."""
    model, encoding = load_model(args.init_from, args.attention, args.encoding, args.adapter, args.merge)
    if args.attention is None:  # the checkpoint's backend (--attention was checked before loading)
        check_attention(model.config.attention, args.device, given=False)
    if args.encoding is None:
        try:  # a tokenizer recorded by training (a Hugging Face cache folder) may not exist on this machine
            tokenizer_file(encoding)
        except ValueError:
            raise UsageError(f"the model's tokenizer {encoding!r} is not on this machine: pass --encoding "
                             f"({TOKENIZERS})") from None
    try:
        enc = get_encoding(encoding)
    except (ValueError, DataUnavailableError) as e:  # a file that is no tokenizer.json, tiktoken's files offline
        raise UsageError(f"the tokenizer {encoding!r} does not load: {e}") from None
    chat_with = chat_template(encoding, args.chat_template) if args.chat else None
    dtype = resolve_dtype(args.dtype, args.device, key="--dtype")
    return model.to(device=args.device, dtype=dtype).eval(), enc, chat_with


def chat_template(encoding: str, name: str | None) -> Chat:
    """The template named (PROMPT_TEMPLATES), else the tokenizer's own, and the tokens that end the assistant's turn;
    UsageError naming --chat-template for a tokenizer without a template, or a turn that ends in no single token."""
    from data.sft import PROMPT_TEMPLATES, ChatTemplate, NoChatTemplateError

    try:
        template = ChatTemplate(encoding, name)
    except NoChatTemplateError:
        raise UsageError(f"argument --chat-template: the model's tokenizer ({encoding}) has no chat template: name a "
                         f"plain one, --chat-template {'|'.join(PROMPT_TEMPLATES)}") from None
    try:
        return template, template.end_of_turn()
    except ValueError as e:  # a turn closed by several tokens
        raise UsageError(f"argument --chat-template: {e}") from None


def texts(args: argparse.Namespace) -> list[str]:
    """The prompts: the file's text, every --prompt, or one empty prompt."""
    return [args.prompt_file.read_text()] if args.prompt_file else args.prompt or [""]


def generate(args: argparse.Namespace, model: GPT, rows: list[list[int]],
             stop_tokens: Collection[int] | None = None) -> Iterator[torch.Tensor]:
    """The new tokens (B, 1) of the prompts' token ids, right-padded into one batch (B, longest) with each row's
    length; UsageError for ids beyond the model's vocabulary."""
    top = max(max(row) for row in rows)
    if top >= model.config.vocab_size:
        raise UsageError(f"the prompt's token ids reach {top}, beyond the model's vocabulary of "
                         f"{model.config.vocab_size}: pick the tokenizer it was trained with (--encoding)")
    idx = torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for row in rows], batch_first=True).to(args.device)
    return stream(model, idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                  use_cache=not args.no_cache, lengths=[len(row) for row in rows], compile=args.compile,
                  stop_tokens=stop_tokens)


def show(enc: Encoding, rows: list[tuple[str, list[int]]], tokens: Iterator[torch.Tensor],
         stop: Collection[int] = ()) -> list[str]:
    """Print each row (head, token ids): its head and then the text of its new tokens, up to its first stop token
    (not printed); one row as its tokens come, several when all are done, separated by a line of dashes. Returns
    each row's new text."""
    if len(rows) == 1:
        head, context = rows[0]
        print(head, end="", flush=True)
        # A token may end inside a UTF-8 character: print only what decodes completely so far.
        decode, pieces = stream_decoder(enc, context=context), []
        for token in map(int, tokens):
            if token in stop:
                break
            pieces.append(decode(token))
            print(pieces[-1], end="", flush=True)
        pieces.append(decode.flush())
        print(pieces[-1])
        return ["".join(pieces)]
    new = torch.cat(list(tokens), dim=1).tolist()  # (B, steps)
    answers = []
    for i, ((head, context), sample) in enumerate(zip(rows, new, strict=True)):
        sample = sample[:next((j for j, token in enumerate(sample) if token in stop), len(sample))]
        decode = stream_decoder(enc, context=context)
        answers.append("".join(decode(t) for t in sample) + decode.flush())
        if i:
            print("\n" + "-" * 40)
        print(head + answers[-1])
    return answers


def chat(args: argparse.Namespace, model: GPT, enc: Encoding, template: ChatTemplate, stop: list[int]) -> None:
    """Answer each prompt as a user's message (--num-samples answers each, one batch), or, with none (stdin a
    terminal), converse: a user's line, the answer, until an empty line or the end of input."""
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    if args.prompt is not None or args.prompt_file is not None:  # check_args read a piped stdin into args.prompt
        prompts = [render(template, [*messages, {"role": "user", "content": text.rstrip()}]) for text in texts(args)]
        rows = [("", ids) for ids in prompts for _ in range(args.num_samples)]
        show(enc, rows, generate(args, model, [ids for _, ids in rows], stop), stop)
        return
    print("an empty line or the end of input (Ctrl-D) ends the conversation", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        if not line.strip():
            return
        messages.append({"role": "user", "content": line.rstrip()})
        ids = render(template, messages)
        [answer] = show(enc, [("", ids)], generate(args, model, [ids], stop), stop)
        messages.append({"role": "assistant", "content": answer})


def render(template: ChatTemplate, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of the conversation and the generation prompt; UsageError for a template that fails on it."""
    try:
        return template.generation_prompt(messages)
    except Exception as e:  # jinja2's TemplateError (raise_exception), or any error of the template's code
        from data.sft import PROMPT_TEMPLATES

        raise UsageError(f"the chat template failed to render the conversation ({type(e).__name__}: {e}): change "
                         "the conversation (some templates take no system message: --system), or render with a "
                         f"plain template, --chat-template {'|'.join(PROMPT_TEMPLATES)}") from None


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = check_args(p, p.parse_args(argv))
    try:
        model, enc, chat_with = prepare(args)
        torch.manual_seed(args.seed)
        if chat_with is not None:
            chat(args, model, enc, *chat_with)
            return
        # Every prompt num_samples times: one row each of a single batch.
        prompts = [(text, enc.encode(text, allowed_special="all") or [enc.eot_token]) for text in texts(args)]
        rows = [row for row in prompts for _ in range(args.num_samples)]
        show(enc, rows, generate(args, model, [ids for _, ids in rows]))
    except UsageError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
