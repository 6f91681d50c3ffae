from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from gateway.bench.dataset import (
    SAFE_ID_RANGE,
    DatasetError,
    file_prompts,
    load_tokenizer,
    random_prompts,
)

CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Prefill workers build KV blocks; decode workers stream tokens back to the gateway.",
    "Pack my box with five dozen liquor jugs! 0123456789 ,.;:?",
] * 20


def make_tokenizer(tmp_path: Path) -> Path:
    """A small byte-level BPE tokenizer (with special tokens) saved as DIR/tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    folder = tmp_path / "tok"
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_token_id_prompts_have_exact_lengths_and_are_reproducible() -> None:
    a = random_prompts(5, 32, 8, "/v1/completions", seed=1)
    b = random_prompts(5, 32, 8, "/v1/completions", seed=1)
    c = random_prompts(5, 32, 8, "/v1/completions", seed=2)
    assert [p.prompt for p in a] == [p.prompt for p in b] != [p.prompt for p in c]
    for p in a:
        assert isinstance(p.prompt, list) and len(p.prompt) == p.prompt_len == 32
        assert all(SAFE_ID_RANGE[0] <= i < SAFE_ID_RANGE[1] for i in p.prompt)
        assert p.output_len == 8 and p.messages is None


def test_text_prompts_encode_to_the_requested_length_without_special_tokens(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(make_tokenizer(tmp_path)))
    special = set(tokenizer.get_added_tokens_decoder())
    prompts = random_prompts(20, 50, 4, "/v1/completions", seed=0, tokenizer=tokenizer)
    for p in prompts:
        assert isinstance(p.prompt, str)
        ids = tokenizer.encode(p.prompt, add_special_tokens=False).ids
        assert len(ids) == p.prompt_len
        assert not special & set(ids)
    assert sum(p.prompt_len == 50 for p in prompts) >= 18  # exact, bar rare round-trip drift


def test_chat_prompts_are_user_messages(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(make_tokenizer(tmp_path) / "tokenizer.json"))
    (p,) = random_prompts(1, 10, 4, "/v1/chat/completions", seed=0, tokenizer=tokenizer)
    assert p.prompt is None and p.messages and p.messages[0]["role"] == "user"


def test_chat_without_a_tokenizer_says_what_is_missing() -> None:
    with pytest.raises(DatasetError, match="--tokenizer"):
        random_prompts(1, 10, 4, "/v1/chat/completions", seed=0)


def test_missing_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_prompts_file_lines_are_used_in_order_and_repeated(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello there"}, {"prompt": [5, 6, 7], "max_tokens": 3}, {}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n")
    prompts = file_prompts(str(path), 5, 9, "/v1/completions")
    assert [p.prompt for p in prompts] == ["hello there", [5, 6, 7]] * 2 + ["hello there"]
    assert [p.output_len for p in prompts[:2]] == [9, 3]
    assert prompts[1].prompt_len == 3


def test_prompts_file_messages_need_the_chat_endpoint(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (p,) = file_prompts(str(path), 1, 4, "/v1/chat/completions")
    assert p.messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(DatasetError, match=r"p\.jsonl:1: 'messages' needs --endpoint"):
        file_prompts(str(path), 1, 4, "/v1/completions")


@pytest.mark.parametrize(
    ("text", "message"), [("{nope", "not JSON"), ("[1]", "JSON object"), ("{}", "'prompt'")]
)
def test_bad_prompt_file_lines_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + text + "\n")
    with pytest.raises(DatasetError, match=f"p.jsonl:2: .*{message}"):
        file_prompts(str(path), 2, 4, "/v1/completions")


def test_one_token_prompts_are_never_empty(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(make_tokenizer(tmp_path)))
    prompts = random_prompts(30, 1, 4, "/v1/completions", seed=3, tokenizer=tokenizer)
    assert all(p.prompt and p.prompt_len >= 1 for p in prompts)
