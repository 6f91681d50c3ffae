"""Tokenizers of the kinds served models ship, built offline and tiny, each beside a tiny random
Llama/Qwen2 checkpoint whose vocabulary matches it: for text-fidelity tests that compare what
Tandem returns with ``transformers``' ``decode`` and ``apply_chat_template``.

- ``byte_level``: GPT-2 style byte-level BPE with Llama 3's pre-tokenizer regex (Llama 3, Qwen2,
  SmolLM); its chat template is Llama 3's or Qwen2's (with tools), chosen by ``template``;
- ``sentencepiece``: Llama 2 / Mistral style BPE with byte fallback (``<0xE4>`` pieces), a
  ``▁`` for spaces, a BOS added; with Mistral's template, which refuses a system message and
  roles that do not alternate.

Training takes a fraction of a second; the text is chosen so that characters outside the
trained alphabet (CJK, emoji) are spelt in bytes: split over several tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "numbers 12345 and 3.14159, and symbols: @#$%^&*()",
    "东京是日本的首都。北京是中国的首都。你好，世界！",
    "Emoji: 😀 🎉 👍🏽 ❤️ and accents: café naïve résumé",
]

SPECIAL_BYTE_LEVEL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
]  # fmt: skip

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

QWEN2_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls | default([]) %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "qwen2": QWEN2_TEMPLATE, "mistral": MISTRAL_TEMPLATE}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _corpus() -> list[str]:
    return CORPUS * 20


def byte_level_tokenizer(template: str = "llama3") -> Any:
    """A transformers fast tokenizer: byte-level BPE, Llama 3's split regex, ~500 tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_BYTE_LEVEL, show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer)
    if template == "llama3":
        bos, eos = "<|begin_of_text|>", "<|eot_id|>"
    else:
        bos, eos = None, "<|im_end|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos,
        chat_template=TEMPLATES[template], clean_up_tokenization_spaces=False,
    )  # fmt: skip


def sentencepiece_tokenizer() -> Any:
    """A Llama 2 style tokenizer: ``▁`` BPE with byte fallback (256 ``<0xNN>`` pieces), the
    alphabet limited so that rare characters are spelt in bytes, BOS added; Mistral's
    template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, limit_alphabet=70, special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )  # fmt: skip
    trained.train_from_iterator(_corpus(), trainer)
    spec = json.loads(trained.to_str())
    learnt = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [t for t in learnt if t not in pieces]
    spec["model"].update(
        vocab={t: i for i, t in enumerate(pieces)}, byte_fallback=True, fuse_unk=True
    )
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template=MISTRAL_TEMPLATE, clean_up_tokenization_spaces=False,
    )  # fmt: skip


def tiny_model(path: Path, tokenizer: Any, model_type: str = "llama", seed: int = 0) -> Path:
    """A seeded random float32 checkpoint at ``path`` with ``tokenizer`` saved beside it (its
    vocabulary the tokenizer's). The output layer favours the tokens that spell rare characters
    in bytes, so greedy outputs hold split characters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    vocab = len(tokenizer)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
