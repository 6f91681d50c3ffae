"""Where the embedded model's GGUF comes from, and the override for machines without the package."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from protos.errors import ConfigError
from services.model_files import (
    ModelNotFoundError,
    embedded_gguf_path,
    gateway_tokenizer_dir,
    model_files_dir,
    resolve_model,
    resolve_tokenizer_dir,
    served_model_name,
)


def test_override_points_the_embedded_model_at_another_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANDEM_EMBEDDED_GGUF", raising=False)
    packaged = embedded_gguf_path()
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(packaged, copy)
    monkeypatch.setenv("TANDEM_EMBEDDED_GGUF", str(copy))
    files = resolve_model("embedded")
    assert files.kind == "gguf" and files.path == copy
    assert files.hf_dir is not None and files.hf_dir != resolve_model(str(packaged)).hf_dir


def test_override_to_a_missing_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_EMBEDDED_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(
        ModelNotFoundError, match=r"TANDEM_EMBEDDED_GGUF=.*nope\.gguf is not a file"
    ):
        resolve_model("embedded")


def test_served_model_name() -> None:
    assert served_model_name("embedded") == "SmolLM2-135M-Instruct"
    assert served_model_name("/no/such/model") == "/no/such/model"


def test_a_model_directory_is_served_under_the_model_string(tmp_path: Path) -> None:
    """As vLLM does: `--model /models/My-Model` is served as "/models/My-Model"."""
    directory = tmp_path / "My-Model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    assert served_model_name(str(directory)) == str(directory)


def test_gateway_tokenizer_dir(tmp_path: Path) -> None:
    embedded = resolve_tokenizer_dir("embedded")
    assert (Path(embedded) / "tokenizer.json").is_file()
    assert gateway_tokenizer_dir("whatever", embedded) == embedded  # --tokenizer wins
    assert gateway_tokenizer_dir(embedded, None) == embedded  # a directory with tokenizer.json
    assert gateway_tokenizer_dir("embedded", None) == embedded
    with pytest.raises(ConfigError, match="cannot find a tokenizer for --model"):
        gateway_tokenizer_dir(str(tmp_path / "nothing-here"), None)


def test_model_files_dir_is_where_generation_config_json_is_read(tmp_path: Path) -> None:
    embedded = resolve_tokenizer_dir("embedded")
    assert model_files_dir(str(tmp_path), None, "tok") == str(tmp_path)  # a model directory
    assert model_files_dir("embedded", None, embedded) == embedded  # the converted GGUF
    assert model_files_dir("embedded", str(tmp_path), str(tmp_path)) == embedded
    assert model_files_dir("llama-3.1-8b", None, embedded) is None  # a named config: no file
    assert model_files_dir(str(tmp_path / "nothing-here"), None, "tok") is None
