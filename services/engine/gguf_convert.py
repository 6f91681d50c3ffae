"""Convert a GGUF checkpoint into a Hugging Face directory (float32 safetensors + tokenizer)."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import save_file


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF file three times to build a tokenizer, a config and a model
    (``gguf.GGUFReader`` on each: ~10 s for the embedded model, its 49k-token vocabulary and
    merges parsed an element at a time) and asks ``gguf.get_tensor_name_map`` again for each of
    its tensors (~14 s for 272). Both are pure functions of their arguments, imported from
    ``gguf`` when called, so for the conversion they are memoized there: the embedded model
    converts in ~16 s instead of ~60 on a 2-core machine. (Where a transformers version imports
    them otherwise, this changes nothing but the time.)"""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(saved[0])  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved  # type: ignore[misc]


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf_path.name} into {out_dir.parent} (once) ...", flush=True)
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
