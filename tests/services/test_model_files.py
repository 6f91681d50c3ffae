"""Where the embedded model's GGUF comes from, and the override for machines without the package."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.model_files import ModelNotFoundError, embedded_gguf_path, resolve_model


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
