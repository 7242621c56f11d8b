"""A real-architecture test model, built locally: a random-weight Qwen3 from ``transformers``' config class
with a tokenizer trained here by ``tokenizers`` -- byte-level BPE (GPT-2/Qwen/Llama-3 style) or
Metaspace (SentencePiece style) -- a Jinja chat template with tool support, a list of EOS ids in
``generation_config``, no pad token, and weights saved as several safetensors shards.

The chat template and its special tokens are those of a model family (``FAMILIES``), written here after
the families' published templates, with their refusals (``raise_exception``) kept:

- ``chatml`` (Qwen3): ``<|im_start|>role ... <|im_end|>``, tools in the system turn, calls as
  ``<tool_call>`` JSON, results as a user turn;
- ``llama3`` (Llama-3.1): header ids, ``<|eot_id|>``, a dated system header, the tools in the first user
  message, one tool call per reply (two raise "This model only supports single tool-calls at once!"),
  tool results in the ``ipython`` role;
- ``mistral`` (Mistral-7B-Instruct-v0.3): ``[INST]``, ``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]`` and
  ``[TOOL_RESULTS]``, the system prompt inside the last user message, tool-call ids that must be 9
  characters, user/assistant alternation enforced;
- ``gemma`` (Gemma-2): ``<start_of_turn>user|model``; a system role and roles that do not alternate are
  refused.

Every family's markers are special added tokens of the trained tokenizer. The char model hides tokenizer,
template and tool-call bugs; this one does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Multilingual text with emoji, accents and CJK, so that the trained vocabulary holds tokens that are
# parts of one character (byte-level) and word-initial markers (Metaspace).
CORPUS = [
    "Résumé 😀 naïve café déjà vu",
    "日本語のテキストと中文文本 🎉🚀",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "set_timer", "arguments": {"minutes": 47}}',
    "Grüße aus Köln – señor, ça va? ✓ ½ €",
    "  leading spaces and\ttabs\nnew lines  ",
    "emoji sequences 👩‍💻 🇫🇷 👍🏽",
]

# ChatML as Qwen writes it: every literal is an expression, so `{%-` trims nothing that matters.
CHATML = """\
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}
{{- '# Tools\\n<tools>' -}}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\nCall a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' + (m.content or '') -}}
{%- for tc in m.tool_calls or [] -%}
{%- set args = tc.function.arguments -%}
{{- '<tool_call>\\n{"name": "' + tc.function.name + '", "arguments": ' -}}
{{- (args if args is string else args | tojson) + '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}
{%- elif m.role != 'system' or not loop.first -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Llama-3.1 as Meta writes it (abridged: no built-in tools, no custom_tools), tools in the first user turn.
LLAMA3 = """\
{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content'] | trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- "<|start_header_id|>user<|end_header_id|>\\n\\n" }}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# Mistral-7B-Instruct-v0.3's tool template: the system prompt joins the LAST user message only.
MISTRAL = """\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace(index=0) %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}{{- '"' + key + '": "' + val + '"' }}
                    {%- else %}{{- '"' + key + '": ' + val | tojson }}{%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function | tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id | length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] | trim + eos_token }}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Gemma-2: no system role, strict alternation, the assistant is the "model".
GEMMA = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{{- raise_exception('System role not supported') }}{%- endif %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}{%- set role = 'model' %}{%- else %}{%- set role = message['role'] %}{%- endif %}
    {{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""


@dataclass(frozen=True)
class Family:
    """A chat-model family: its template, special tokens, BOS/EOS, the ids that end a reply, its tokenizer."""

    template: str
    special: tuple[str, ...]
    eos: str
    ends: tuple[str, ...]  # generation_config.eos_token_id
    bos: str | None = None
    unk: str | None = None
    kind: str = "bytelevel"


FAMILIES = {
    "chatml": Family(CHATML, tuple(SPECIAL), "<|im_end|>", ("<|im_end|>", "<|endoftext|>")),
    "llama3": Family(
        LLAMA3,
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        "<|eot_id|>",
        ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
    ),  # fmt: skip
    "mistral": Family(
        MISTRAL,
        (
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        "</s>",
        ("</s>",),
        bos="<s>",
        unk="<unk>",
        kind="metaspace",
    ),  # fmt: skip
    "gemma": Family(
        GEMMA,
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        "<eos>",
        ("<eos>", "<end_of_turn>"),
        bos="<bos>",
        unk="<unk>",
        kind="metaspace",
    ),  # fmt: skip
}


def train_tokenizer(kind: str | None = None, vocab_size: int = 400, *, family: str = "chatml"):
    """A fast tokenizer trained on ``CORPUS``: ``bytelevel`` BPE or ``metaspace`` BPE with byte fallback
    (default: the family's), with the ``family``'s special tokens and chat template."""
    fam = FAMILIES[family]
    kind = kind or fam.kind
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        # Llama-2 / Mistral's tokenizer.json decoder: a token alone loses its leading space (Strip).
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        alphabet = []
    else:
        raise ValueError(kind)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if kind == "metaspace" else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + len(byte_tokens),
        special_tokens=[*fam.special, *byte_tokens],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=fam.eos, bos_token=fam.bos, unk_token=fam.unk
    )
    fast.chat_template = fam.template
    return fast


def build_real_model(
    path: Path,
    *,
    kind: str | None = None,
    family: str = "chatml",
    seed: int = 0,
    shards: int = 3,
    sharpness: float = 20.0,
) -> Path:
    """Save a random-weight Qwen3 with a trained tokenizer and the ``family``'s chat template under ``path``
    (no pad token; sharded).

    ``sharpness`` scales the embeddings and the output layer: sharp logits make greedy output far from
    uniform (what decoding tests need); 1.0 keeps the standard initialisation, which fine-tuning moves
    more easily (what loop tests need)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    fam = FAMILIES[family]
    tok = train_tokenizer(kind, family=family)
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tok.convert_tokens_to_ids(fam.eos),
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # sharp logits: greedy output is far from uniform, and rarely an end token
        model.model.embed_tokens.weight.mul_(sharpness)
        model.lm_head.weight.mul_(sharpness)
        model.lm_head.weight[[tok.convert_tokens_to_ids(t) for t in fam.special]].mul_(0.2)
    model.generation_config = GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids(t) for t in fam.ends])
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max(size // shards + 1, 1))
    tok.save_pretrained(path)
    return path
