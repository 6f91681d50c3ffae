"""``tandem generate`` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from protos.sampling_params import InvalidRequestError
from services.engine.offline_cli import _prompt_line


def _tandem(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "services.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_chat_prompt_answers_paris() -> None:
    res = _tandem("--chat", "--prompt", "What is the capital of France?", "--max-tokens", "24")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Paris" in res.stdout


def test_prompts_file_json_output(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}]})
        + "\n" + json.dumps({"prompt": "The sky is"}) + "\n"
    )  # fmt: skip
    res = _tandem("--prompts-file", str(f), "--max-tokens", "12", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    assert "Paris" in rows[0]["text"] and rows[0]["finish_reason"] in ("stop", "length")
    assert rows[1]["prompt_token_ids"] and len(rows[1]["token_ids"]) <= 12


def test_errors_are_clear_and_exit_nonzero(tmp_path: Path) -> None:
    res = _tandem("--prompt", "hi", "--temperature", "-1")
    assert res.returncode == 2 and "temperature" in res.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    res = _tandem("--prompts-file", str(bad))
    assert res.returncode == 2 and "bad.jsonl:1" in res.stderr
    # a key no line takes (an option per line) is refused, not ignored
    bad.write_text(
        json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "hi", "lora_name": "x"})
    )
    res = _tandem("--prompts-file", str(bad))
    assert res.returncode == 2 and "bad.jsonl:2: key(s) not supported: lora_name" in res.stderr
    assert "Traceback" not in res.stderr
    res = _tandem("--prompts-file", str(tmp_path))  # a directory
    assert res.returncode == 2 and "--prompts-file" in res.stderr and "Traceback" not in res.stderr
    bad.write_text("\n\n")
    res = _tandem("--prompts-file", str(bad))
    assert res.returncode == 2 and "holds no prompt" in res.stderr


def test_a_prompts_file_takes_text_parts_as_the_gateway_does() -> None:
    line = '{"messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}]}'
    assert _prompt_line("p.jsonl:1", line) == {"messages": [{"role": "system", "content": "hi"}]}


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"prompt": "a", "messages": []}', 'expected {"prompt": "..."} or {"messages": [...]}'),
        ("[1, 2]", 'expected {"prompt": "..."} or {"messages": [...]}'),
        ('{"prompt": 7}', '"prompt" must be a string'),
        ('{"messages": "hi"}', '"messages" must be a non-empty list'),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"prompt": "a", "temperature": 0}', "key(s) not supported: temperature"),
        # messages are checked as the gateway checks a chat request's
        ('{"messages": [{"role": "user", "contentx": "hi"}]}', "messages[0].contentx"),
        ('{"messages": ["hi"]}', "messages[0] must be an object"),
        ('{"messages": [{"role": "wizard", "content": "hi"}]}', "got 'wizard'"),
        ('{"messages": [{"role": "user", "content": "hi", "foo": 1}]}', "messages[0].foo"),
    ],
)
def test_a_prompts_file_line_of_another_shape_is_refused(line: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _prompt_line("p.jsonl:3", line)
    assert str(info.value).startswith("p.jsonl:3: ") and words in str(info.value)


def test_max_tokens_past_the_context_is_refused_with_the_limit() -> None:
    res = _tandem("--prompt", "hi", "--max-tokens", "100000", timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "maximum context length is 2048 tokens" in res.stderr
    assert "100000 in the completion" in res.stderr


def test_an_unsupported_architecture_is_a_clean_error(tmp_path: Path) -> None:
    config = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 100, "intermediate_size": 128}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    res = _tandem("--model", str(tmp_path), "--load-format", "dummy", "--prompt", "hi")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "model_type 'gpt_neox' is not supported" in res.stderr
    assert "Traceback" not in res.stderr


def test_heads_that_cannot_be_split_over_the_ranks_are_a_clean_error() -> None:
    """SmolLM2's 9 query and 3 KV heads over 4 ranks: refused before any rank starts."""
    res = _tandem("--tensor-parallel-size", "4", "--prompt", "hi", timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--tensor-parallel-size 4: 3 KV heads and 9 query heads cannot be split" in res.stderr
    assert "Traceback" not in res.stderr


def test_two_ranks_generate_what_one_does(tmp_path: Path) -> None:
    """`tandem generate --tensor-parallel-size 2` on a tiny random Llama: the tokens of one
    rank, and a clean exit (the rank process stopped)."""
    from protos.sampling_params import SamplingParams
    from services.engine.llm import LLM
    from tests.services.engine.conftest import tiny_checkpoint

    model = str(tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2, hidden_size=64,
                                num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64))  # fmt: skip
    want = LLM(model).generate(["The sky is"], SamplingParams(temperature=0.0, max_tokens=6))
    res = _tandem("--model", model, "--tensor-parallel-size", "2", "--prompt", "The sky is",
                  "--max-tokens", "6", "--json", timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.splitlines()[-1])["token_ids"] == want[0].outputs[0].token_ids


def test_lora_errors_are_clean(tmp_path: Path) -> None:
    """An adapter above --max-lora-rank stops the start (exit 2, the reason, no traceback);
    an adapter name nothing serves is refused."""
    from tests.services.engine.lora.test_adapter import write

    adapter = write(tmp_path / "big", r=32)
    res = _tandem("--prompt", "hi", "--enable-lora", "--lora-modules", f"big={adapter}")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "LoRA adapter 'big': rank 32 exceeds --max-lora-rank 16" in res.stderr
    assert "Traceback" not in res.stderr
    res = _tandem("--prompt", "hi", "--lora-name", "sql", "--max-tokens", "2")
    assert res.returncode == 2 and "LoRA adapter 'sql' is not served here" in res.stderr


def test_an_adapter_for_another_base_model_is_refused_before_loading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.cli import build_parser
    from services.engine.offline_cli import main

    entry = '{"name": "a", "path": "/ad/a", "base_model_name": "llama"}'
    args = build_parser().parse_args(
        ["generate", "--prompt", "hi", "--enable-lora", "--lora-modules", entry]
    )
    assert main(args) == 2
    assert "base_model_name 'llama' is not the model served" in capsys.readouterr().err
