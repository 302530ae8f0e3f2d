"""Chat templates by name: ``data.chat_template=chatml`` means the ChatML template, not the text "chatml".

Each named template renders its family's canonical turn format, appends the assistant header when
asked for a generation prompt, and wraps every assistant answer with its end-of-turn marker in
``{% generation %}`` (transformers' assistant-token mask). Each rendering of a conversation extends
the rendering of its prefixes, which is what ftctl.data.render relies on to find the trained spans.
A system message goes where the family puts it: its own turn (ChatML, Llama 3, Phi-3), ahead of the
first user message (Mistral, Gemma), or as the preamble (Alpaca). Torch-free: the config check
resolves names before anything loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

from ftctl.errors import ConfigError

# In every template the answer, its end-of-turn marker included, is what {% generation %} marks.
_BOS = "{% if bos_token %}{{ bos_token }}{% endif %}"

# The system message folded into the first user turn, for families without a system role: the
# system turn renders nothing while a user turn follows it, and on its own (a completion prompted by
# a system message alone) it renders as a user turn.
_FOLD_SYSTEM = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% set next_role = messages[loop.index0 + 1]['role'] if not loop.last else '' %}"
    "{% if message['role'] == 'system' and next_role == 'user' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% elif message['role'] in ('system', 'user') %}{USER}{% set ns.system = '' %}"
    "{% elif message['role'] == 'assistant' %}{ASSISTANT}"
    "{% endif %}{% endfor %}"
)

CHAT_TEMPLATES: Dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
        "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        _BOS + "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "mistral": _BOS + _FOLD_SYSTEM.replace(
        "{USER}", "{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    ).replace("{ASSISTANT}", "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"),
    "gemma": _BOS + _FOLD_SYSTEM.replace(
        "{USER}", "{{ '<start_of_turn>user\\n' + ns.system + message['content'] + '<end_of_turn>\\n' }}"
    ).replace(
        "{ASSISTANT}",
        "{{ '<start_of_turn>model\\n' }}{% generation %}{{ message['content'] + '<end_of_turn>' }}{% endgeneration %}{{ '\\n' }}",
    )
    + "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    "phi3": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\\n' }}"
        "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
    "alpaca": (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "{{ 'Below is an instruction that describes a task. Write a response that appropriately completes the request.\\n\\n' }}"
        "{% endif %}"
        "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ '### Response:\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    ),
}


#: The special tokens each named template writes, which its family's tokenizer holds as single tokens. Mistral's
#: [INST] markers are not listed: its original tokenizer reads them as plain text; its end of turn is EOS.
TEMPLATE_SPECIAL_TOKENS: Dict[str, tuple] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "mistral": (),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "phi3": ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    "alpaca": (),
}


def resolve_chat_template(value: str, key: str = "data.chat_template") -> str:
    """The Jinja text a ``chat_template`` value stands for: a named template, a Jinja string, or a file's content."""
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{key}={value}: cannot read the template file ({exc})") from None
    from ftctl.errors import did_you_mean

    raise ConfigError(
        f"{key}='{value}' is not a template name, a Jinja template or an existing .jinja file.{did_you_mean(value, CHAT_TEMPLATES)} "
        f"Names: {', '.join(CHAT_TEMPLATES)}"
    )
