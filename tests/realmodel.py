"""A real-architecture test model, built locally: a random-weight Qwen3 from ``transformers``' config class
with a tokenizer trained here by ``tokenizers`` -- byte-level BPE (GPT-2/Qwen/Llama-3 style) or
Metaspace (SentencePiece style) -- a ChatML Jinja chat template with tool support, a list of EOS ids
in ``generation_config``, no pad token, and weights saved as several safetensors shards.

The char model hides tokenizer, template and tool-call bugs; this one does not.
"""

from __future__ import annotations

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


def train_tokenizer(kind: str = "bytelevel", vocab_size: int = 400):
    """A fast tokenizer trained on ``CORPUS``: ``bytelevel`` BPE or ``metaspace`` BPE with byte fallback."""
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
        special_tokens=SPECIAL + byte_tokens,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None)
    fast.chat_template = CHATML
    return fast


def build_real_model(
    path: Path, *, kind: str = "bytelevel", seed: int = 0, shards: int = 3, sharpness: float = 20.0
) -> Path:
    """Save a random-weight Qwen3 with a trained tokenizer under ``path`` (no pad token; sharded).

    ``sharpness`` scales the embeddings and the output layer: sharp logits make greedy output far from
    uniform (what decoding tests need); 1.0 keeps the standard initialisation, which fine-tuning moves
    more easily (what loop tests need)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok = train_tokenizer(kind)
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
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # sharp logits: greedy output is far from uniform, and rarely an end token
        model.model.embed_tokens.weight.mul_(sharpness)
        model.lm_head.weight.mul_(sharpness)
        model.lm_head.weight[[tok.convert_tokens_to_ids(t) for t in SPECIAL]].mul_(0.2)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
    )
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max(size // shards + 1, 1))
    tok.save_pretrained(path)
    return path
