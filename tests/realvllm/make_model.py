# ruff: noqa: E501  (the chat template below is data, kept verbatim)
"""Write the tiny random Qwen2 model that the real-vLLM tier serves (no downloads).

Run with vLLM's interpreter (it has torch, transformers and tokenizers), not the project's:
`$GATEWAY_VLLM_PYTHON tests/realvllm/make_model.py OUT_DIR`. The result is a Hugging Face
folder: a `Qwen2ForCausalLM` with seeded random weights (hidden 256, 4 heads so head_dim is
64, which the CPU attention backend accepts; 2 layers; vocab 2048) and a byte-level BPE
tokenizer trained on seeded text, with Qwen2.5's ChatML chat template (its default system
prompt and tool-call shape included). Output is gibberish; the gateway only needs real
tokens, a real prefix cache and real usage. Same seed, same files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB = 2048
SEED = 1234

# Qwen2.5-Instruct's template, shortened only in the tool-call instructions' wording.
CHAT_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


# transformers' Qwen2Tokenizer split pattern (digits one by one).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

def _corpus(rng: random.Random) -> list[str]:
    words = ["the", "cache", "prefix", "block", "token", "replica", "gateway", "request",
             "tool", "result", "file", "def", "return", "import", "class", "json", "name",
             "arguments", "user", "assistant", "system", "error", "value", "list", "data"]
    lines = []
    for _ in range(4000):
        n = rng.randint(3, 20)
        lines.append(" ".join(rng.choice(words) + rng.choice(["", "s", "ing", "_id", "()"])
                              for _ in range(n)))
        lines.append("".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(5, 60))))
    return lines


def write(out: Path) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    tok = Tokenizer(models.BPE())
    # Qwen2's own pre-tokenizer, as in its tokenizer.json: vLLM loads a qwen2 model's
    # tokenizer with transformers' Qwen2Tokenizer, which (transformers >= 5) rebuilds the
    # pre-tokenizer from this regex whatever tokenizer.json says; with any other one here the
    # gateway's tokens (from tokenizer.json) and the replica's differ.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=True, torch_dtype="bfloat16",
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": config.eos_token_id, "bos_token_id": config.bos_token_id,
    }))


if __name__ == "__main__":
    write(Path(sys.argv[1]))
