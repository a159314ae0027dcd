"""A byte-level BPE tokenizer for tiny random models, able to spell any text (JSON, tool
calls), with a Qwen2.5-style chat template that renders `tools` and tool-call history."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
# 256 byte tokens, 6 merges, the specials: 267 ids. The model's vocabulary is larger
# (padded, as Qwen's is), so masks must cover ids no tokenizer token has.
MODEL_VOCAB = 288

# Qwen2.5-Instruct's template, shortened (same structure: tools in the system turn, tool
# calls as <tool_call> JSON, tool results as <tool_response> inside a user turn).
QWEN_TOOLS_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
    or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- set tc = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\n<tool_call>\n{"name": "' + tc.name + '", "arguments": ' }}
{{- tc.arguments if tc.arguments is string else tc.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
IM_END_ID = 262  # after the 256 bytes and 6 merges; the first added token (eos)


def add_byte_tokenizer(model_dir: Path, chat_template: str = QWEN_TOOLS_TEMPLATE) -> None:
    """Save a byte-level BPE tokenizer (GPT-2 byte alphabet) and chat template to model_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    merges = [("Ġ", '"'), ('"', ":"), ("{", '"'), ('"', ","), ("Ġ", "{"), ('"', "}")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2],
    )
    tokenizer.add_tokens(SPECIAL_TOKENS[3:])  # not special, as in Qwen: kept in the text
    tokenizer.chat_template = chat_template
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_ID
    tokenizer.save_pretrained(str(model_dir))


def tiny_byte_model_dir(family: str, root: Path, seed: int = 0) -> Path:
    """A tiny random model of `family` with the byte-level tokenizer and tools template."""
    from tests.support.tiny_models import tiny_model_dir

    path = tiny_model_dir(
        family,
        root,
        seed,
        vocab_size=MODEL_VOCAB,
        eos_token_id=IM_END_ID,
        bos_token_id=None,
        max_position_embeddings=2048,  # tool definitions are long in bytes
    )
    add_byte_tokenizer(path)
    return path
