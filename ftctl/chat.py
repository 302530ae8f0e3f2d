"""`ftctl chat` and `ftctl generate`: try a model at once, or run it over a file of prompts.

Both load through ftctl.evaluation.evaluate (base model, alias, run or adapter dir merged on the
way, merged dir, or a ``.gguf`` file) and generate through ftctl.evaluation.generation with the
chat template the model was trained with. Decoding is greedy unless ``temperature`` is set, so
the same prompt gives the same answer; sampling is seeded by ``seed`` (default 0).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, TextIO

from ftctl.errors import FtctlError
from ftctl.options import number_option
from ftctl.paths import check_output_path, make_parent

Messages = List[Dict[str, str]]

_MODEL_OPTIONS = {
    "model": "model alias, dir, hub id or .gguf file; a run dir, its final/ or a checkpoint dir (adapters are merged)",
    "adapter": "LoRA/DoRA/QLoRA result dir to merge into model= (or into the base its adapter_config.json names)",
    "chat_template": "chat template overriding the tokenizer's: a name (chatml, llama3, mistral, gemma, phi3, alpaca), Jinja or a .jinja file",
    "system": "system message opening every conversation (default: the one the run trained with; system= for none)",
    "max_new_tokens": "tokens generated per answer at most (default 256)",
    "temperature": "0 (default) decodes greedily; above 0 samples",
    "top_p": "sampling: keep the smallest set of tokens with this much probability (default 1.0)",
    "seed": "sampling: random seed, so a run can be repeated (default 0)",
}
#: `ftctl chat` options (key=value).
CHAT_OPTIONS = {**_MODEL_OPTIONS, "prompt": "answer this one message and exit (default: read messages from stdin)"}
#: `ftctl generate` options (key=value).
GENERATE_OPTIONS = {
    **_MODEL_OPTIONS,
    "input": "prompts: .jsonl/.json/.parquet records with a 'prompt' field (text or messages), or records of a data format (required)",
    "output": "the .jsonl file to write, one record per prompt (required)",
    "data.format": "format of records without 'prompt' (alpaca, sharegpt, openai, ...); default: guessed",
    "batch_size": "prompts generated together (default 16)",
    "overwrite": "true to replace an existing output file",
}


@dataclass
class Decoding:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def kwargs(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}


def decoding_from_options(options: Dict[str, str]) -> Decoding:
    decoding = Decoding(
        max_new_tokens=number_option(options, "max_new_tokens", int, 256, 1),
        temperature=number_option(options, "temperature", float, 0.0, 0.0),
        top_p=number_option(options, "top_p", float, 1.0, 0.0, 1.0),
        seed=number_option(options, "seed", int, 0, 0),
    )
    if decoding.top_p == 0:
        raise FtctlError("top_p=0 keeps no token; use a value above 0 (or temperature=0 for greedy decoding)")
    return decoding


def system_prompt(options: Dict[str, str]) -> Optional[str]:
    """system= when given (empty for none), else the system prompt the run behind model=/adapter= trained with."""
    if "system" in options:
        return options["system"] or None
    from ftctl.trained_run import trained_system_prompt

    return trained_system_prompt(options.get("adapter"), options.get("model"))


def load_chat_model(options: Dict[str, str]):
    """(model, tokenizer) for model=/adapter= through the loader eval uses."""
    from ftctl.evaluation.evaluate import load_for_generation, resolve_targets

    if "model" not in options and "adapter" not in options:
        raise FtctlError("say which model to run: model=NAME_OR_DIR_OR_GGUF (and optionally adapter=RUN_OR_ADAPTER_DIR)")
    if options.get("chat_template"):
        from ftctl.config.validate import check_chat_template

        check_chat_template("chat_template", options["chat_template"])
    model, adapter_dir = resolve_targets(options.get("model"), options.get("adapter"))
    return load_for_generation(model, adapter_dir, options.get("chat_template"))


class ChatSession:
    """A conversation with the model: each ask() sees the turns before it, reset() forgets them."""

    def __init__(self, model, tokenizer, decoding: Decoding, system: Optional[str] = None):
        self.model, self.tokenizer, self.decoding, self.system = model, tokenizer, decoding, system
        self.context_limit = getattr(model.config, "max_position_embeddings", None)
        self.messages: Messages = []
        self.dropped = 0  # exchanges the last ask() left out to fit the context
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _fit_context(self, messages: Messages) -> int:
        """How many of the oldest exchanges to leave out so that prompt plus answer fit the model's context."""
        from ftctl.evaluation.generation import prompt_ids

        first = 1 if self.system else 0
        dropped = 0
        while self.context_limit and len(prompt_ids(self.tokenizer, messages[:first] + messages[first + 2 * dropped:])) \
                + self.decoding.max_new_tokens > self.context_limit:
            if len(messages) - first - 2 * dropped <= 1:
                raise FtctlError(
                    f"the message does not fit the model's context of {self.context_limit} tokens "
                    f"with max_new_tokens={self.decoding.max_new_tokens}; shorten it or lower max_new_tokens"
                )
            dropped += 1
        return dropped

    def ask(self, text: str) -> str:
        """The model's answer to ``text`` after the conversation so far; a message that cannot fit changes nothing."""
        from ftctl.evaluation.generation import generate

        first = 1 if self.system else 0
        messages = self.messages + [{"role": "user", "content": text}]
        self.dropped = self._fit_context(messages)
        messages = messages[:first] + messages[first + 2 * self.dropped:]
        reply = generate(self.model, self.tokenizer, [messages], self.decoding.max_new_tokens, **self.decoding.kwargs())[0]
        self.messages = messages + [{"role": "assistant", "content": reply}]
        return reply


def run_chat(options: Dict[str, str], stdin: Optional[TextIO] = None, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> int:
    """One answer for prompt=, else a conversation read line by line from stdin until EOF or /exit."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    decoding = decoding_from_options(options)
    model, tokenizer = load_chat_model(options)
    session = ChatSession(model, tokenizer, decoding, system_prompt(options))
    if "prompt" in options:
        print(session.ask(options["prompt"]), file=stdout)
        return 0
    interactive = stdin.isatty()
    if interactive:
        print("ftctl chat: type a message; /reset starts over, /exit (or Ctrl-D) ends", file=stderr)
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        command = text.strip()
        if not command:
            continue
        if command == "/exit":
            break
        if command == "/reset":
            session.reset()
            print("(conversation cleared)", file=stderr)
            continue
        try:
            reply = session.ask(text)
        except FtctlError as exc:
            print(f"ftctl: {exc}", file=stderr)
            continue
        if session.dropped:
            print(f"(the {session.dropped} oldest exchange(s) no longer fit the context and were left out)", file=stderr)
        print(reply, file=stdout)
        stdout.flush()
    return 0


@dataclass
class PromptItem:
    messages: Messages
    source: str
    prompt: Optional[object] = None  # the record's own 'prompt' field, echoed back
    reference: Optional[str] = None  # the record's answer, when it carried one
    extra: Dict[str, object] = field(default_factory=dict)  # the record's other fields (an id, ...), passed through


def _prompt_messages(value, source: str, system: Optional[str]) -> Messages:
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str) for m in value
    ):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise FtctlError(f"{source}: 'prompt' must be a string or a list of {{role, content}} messages")
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    return messages


def read_prompts(path: str, data_format: Optional[str] = None, system: Optional[str] = None) -> List[PromptItem]:
    """Prompts from a file: records with a 'prompt' field, or any data format's records cut before their last answer."""
    from data_formats import AUTO
    from ftctl.data.records import read_records

    records = read_records(path)
    if not records:
        raise FtctlError(f"{path}: the file holds no prompts")
    if data_format in (None, AUTO) and "prompt" in records[0].data:
        items = []
        for record in records:
            if "prompt" not in record.data:
                raise FtctlError(f"{record.source}: no 'prompt' field (the file's first record has one)")
            extra = {key: value for key, value in record.data.items() if key != "prompt"}
            items.append(PromptItem(_prompt_messages(record.data["prompt"], record.source, system), record.source,
                                    record.data["prompt"], extra=extra))
        return items
    from ftctl.evaluation.evaluate import held_out_examples

    _, examples = held_out_examples(path, data_format, system)
    return [PromptItem(e.prompt, e.source, reference=e.reference) for e in examples]


def run_generate(options: Dict[str, str]) -> dict:
    """Answer every prompt of input= into the jsonl output=; returns a summary."""
    missing = [key for key in ("input", "output") if key not in options]
    if missing:
        raise FtctlError(f"generate needs {' and '.join(k + '=FILE' for k in missing)}: ftctl generate model=NAME input=FILE output=FILE.jsonl")
    output = Path(options["output"]).expanduser().absolute()
    overwrite = options.get("overwrite", "false").lower()
    if overwrite not in ("true", "false"):
        raise FtctlError(f"overwrite={options['overwrite']}: expected true or false")
    if output.is_dir() or (output.exists() and overwrite != "true"):
        raise FtctlError(f"output={output} exists; choose another file or pass overwrite=true")
    check_output_path(output, "output")
    decoding = decoding_from_options(options)
    batch_size = number_option(options, "batch_size", int, 16, 1)
    items = read_prompts(options["input"], options.get("data.format"), system_prompt(options))
    model, tokenizer = load_chat_model(options)

    from ftctl.evaluation.generation import generate

    outputs = generate(model, tokenizer, [item.messages for item in items], decoding.max_new_tokens, batch_size=batch_size,
                       progress="generate", **decoding.kwargs())
    make_parent(output, "output")
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        with open(staging, "w", encoding="utf-8") as f:
            for item, text in zip(items, outputs):
                row = {**item.extra, "source": item.source}
                if item.prompt is not None:
                    row["prompt"] = item.prompt
                row["messages"] = item.messages
                row["output"] = text
                if item.reference is not None:
                    row["reference"] = item.reference
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(staging, output)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return {"n": len(items), "output": str(output)}
