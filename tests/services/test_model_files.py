"""Where the embedded model's GGUF comes from, and the override for machines without the package."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from protos.errors import ConfigError
from services.model_files import (
    ModelNotFoundError,
    embedded_gguf_path,
    gateway_tokenizer_dir,
    model_files_dir,
    prepare_model,
    resolve_model,
    resolve_tokenizer_dir,
    served_model_name,
)
from services.model_files import main as model_files_main


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


def test_an_existing_path_that_is_no_model_says_what_it_is(tmp_path: Path) -> None:
    """A directory without config.json, a weights file, any other file: each refused with what
    it is and which path to give instead, not as "not found"."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"is a directory without config\.json") as e:
        resolve_model(str(tmp_path / "empty"))
    assert "not found" not in str(e.value)
    snapshot = tmp_path / "hub" / "snapshots" / "abc123"  # a Hugging Face cache's layout
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=re.escape(f"the one below it, {snapshot}")):
        resolve_model(str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match=re.escape(f"holding it, {snapshot},")):
        resolve_model(str(snapshot / "model.safetensors"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match=r"neither a \.gguf file nor a model directory"):
        resolve_model(str(tmp_path / "notes.txt"))


def test_a_gguf_path_that_is_not_gguf_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .gguf file without GGUF's magic bytes (an HTML error page saved under the name) was a
    transformers traceback and exit 1; now one error line, exit 2, and nothing cached."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404</html>")
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf is not a GGUF file"):
        prepare_model(str(fake))
    assert model_files_main(["--model", str(fake)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1
    assert not list((tmp_path / "cache" / "models").glob("model-*"))
    with pytest.raises(ConfigError, match=r"cannot find a tokenizer .*: .*is not a GGUF file"):
        gateway_tokenizer_dir(str(fake), None)  # the gateway says the prepare step's reason


def test_a_gguf_transformers_cannot_convert_is_refused_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "odd.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))

    def refuse(path: Path, out: Path) -> None:
        raise ValueError("GGUF model with architecture oddarch is not supported yet.")

    monkeypatch.setattr("services.engine.gguf_convert.convert_gguf_to_hf", refuse)
    with pytest.raises(ModelNotFoundError, match=r"cannot convert .*odd\.gguf .*oddarch"):
        prepare_model(str(gguf))


def test_a_cache_directory_that_cannot_be_written_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TANDEM_CACHE_DIR (or HOME) where nothing can be written was a traceback and exit 1."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelNotFoundError, match="set TANDEM_CACHE_DIR to a writable directory"):
        prepare_model(str(gguf))
    assert model_files_main(["--model", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert "(Not a directory)" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_an_architecture_no_worker_serves_is_refused_by_the_prepare_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tandem up``'s prepare step reads config.json as the workers will: a model_type the
    engine does not serve is one error line and exit 2 before any worker starts (each worker
    found it at its start, after the launcher had started them all)."""
    model = tmp_path / "gpt2-tiny"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 8}')
    assert model_files_main(["--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1
    assert "model_type 'gpt2' is not supported; supported: llama" in err
    (model / "config.json").write_text("{not json")
    assert model_files_main(["--model", str(model)]) == 2
    assert "is not a readable JSON model config" in capsys.readouterr().err
