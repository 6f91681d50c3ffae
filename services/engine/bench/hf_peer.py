"""The transformers peer of W1, each batch size in its own fresh process.

A peer is measured at its best: in a process of its own, started on a GPU nothing else holds
(run after our engine in the same process, ``generate`` was 28% slower: the allocator and the
CUDA context were ours), at its best batch size. ``tandem bench offline --compare-transformers``
runs this module once per batch size before it loads its own engine; each run builds the model
(random weights from the same config for ``--load-format dummy``, the checkpoint otherwise),
generates exactly ``--output-len`` tokens for every prompt (``min_new_tokens``, greedy) and
prints one JSON line::

    python -m services.engine.bench.hf_peer --model llama-3.1-8b --load-format dummy \
        --num-prompts 256 --input-len 1024 --output-len 128 --batch-size 128

The prompts are ours, id for id (``random_prompts``; the first ``--num-prompts`` of them when
``--peer-num-prompts`` times fewer: static batches of the same shape run at the same speed, so
whole batches of the first prompts give the peer's throughput). With ``--image-size`` (a
vision-language model) each prompt opens with the same random image as ours, its placeholder
expanded by the same code (``image_prompts``), its pixels preprocessed by the same processor
(``services.engine.vision.preprocess``) inside the timed run, as ours are.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from protos.multimodal import ImageItem, VisionSpec, place_images

PEER_TIMEOUT_S = 900.0


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The prompts of W1 (ours and the peer's are the same ids)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()


def image_prompts(
    spec: VisionSpec, prompts: list[list[int]], size: int, seed: int = 0
) -> tuple[list[list[int]], list[tuple[ImageItem, ...]]]:
    """W1 with images: each prompt opens with its own random ``size`` x ``size`` image (a
    distinct one each, so neither the prefix cache nor the encoder cache helps), its placeholder
    expanded to the image's token count; random ids that happen to be vision tokens become 100."""
    import numpy as np
    from PIL import Image

    special = {spec.image_token_id, spec.vision_start_id, spec.vision_end_id}
    head = [spec.vision_start_id, spec.image_token_id, spec.vision_end_id]
    rng = np.random.default_rng(seed)
    out_ids, out_images = [], []
    for prompt in prompts:
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, format="PNG")
        text = [100 if t in special else t for t in prompt]
        ids, items = place_images(head + text, spec, [buf.getvalue()])
        out_ids.append(ids)
        out_images.append(items)
    return out_ids, out_images


def model_dir(model: str) -> Path:
    """The directory of the model's config.json (a named config's own, for those kept as one)."""
    where, _ = _config_dir_or_file(model)
    return where.parent if where.is_file() else where


def vision_spec(model: str) -> VisionSpec | None:
    """How the model's images become placeholder tokens; None for a text-only model."""
    return VisionSpec.of_model_dir(model_dir(model))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_hf(
    hf: Any, prompts: list[list[int]], output_len: int, batch: int,
    images: list[tuple[ImageItem, ...]] | None = None, processor: Any = None,
    generated: list[int] | None = None,
) -> float:  # fmt: skip
    """Seconds for transformers ``generate`` to give every prompt ``output_len`` tokens
    (``images``: each prompt's, preprocessed by ``processor`` batch by batch in the timed run;
    ``generated`` collects the tokens each batch got)."""
    import torch

    dev = next(hf.parameters()).device
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=dev)
        extra = {} if images is None else _image_inputs(hf, processor, images[i : i + batch], ids)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, pad_token_id=0,
                              **extra)  # fmt: skip
        if generated is not None:
            generated.append(ids.shape[0] * (out.shape[1] - ids.shape[1]))
    _sync()
    return time.perf_counter() - t0


def _image_inputs(
    hf: Any, processor: Any, images: list[tuple[ImageItem, ...]], ids: Any
) -> dict[str, Any]:
    """generate's image arguments for a batch: every image's patches in prompt order, as our
    worker preprocesses them, and their grids."""
    import numpy as np
    import torch

    from services.engine.vision import preprocess

    items = [item for pics in images for item in pics]
    pixels = np.concatenate([preprocess(processor, item) for item in items])
    out: dict[str, Any] = {
        "pixel_values": torch.from_numpy(pixels).to(ids.device),  # [patches, C*tp*p*p]
        "image_grid_thw": torch.tensor([item.grid for item in items], device=ids.device),
    }
    if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:  # transformers 5's M-RoPE
        out["mm_token_type_ids"] = (ids == hf.config.image_token_id).int()
    return out


def _config_dir_or_file(model: str) -> tuple[Path, bool]:
    """(a config.json or an HF directory, whether real weights sit beside it)."""
    from services.model_files import is_prepared, prepare_model, resolve_model

    files = resolve_model(model)
    if files.kind == "named":
        return files.path, False
    if files.kind == "gguf" and not is_prepared(files):
        files = prepare_model(model)  # the checkpoint converted from the GGUF
    assert files.hf_dir is not None
    return files.hf_dir, True


def _auto_class(cfg: Any) -> Any:
    """transformers' auto class for the config: image-text-to-text for a vision-language model
    (Qwen2VLForConditionalGeneration), causal LM otherwise."""
    import transformers

    if getattr(cfg, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def build_peer(model: str, load_format: str, dtype_name: str) -> Any:
    import torch
    from transformers import AutoConfig

    where, has_weights = _config_dir_or_file(model)
    if where.is_file():
        raw = json.loads(where.read_text())
        cfg = AutoConfig.for_model(
            raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"}
        )
    else:
        cfg = AutoConfig.from_pretrained(where)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype_name == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, dtype_name)
    model_class = _auto_class(cfg)
    if has_weights and load_format != "dummy":
        hf = model_class.from_pretrained(where, dtype=dtype, device_map=dev.type)
    else:  # random weights: the speed of generate does not depend on their values
        with dev:
            hf = model_class.from_config(cfg, dtype=dtype)
    return hf.eval()


def _workload(
    args: argparse.Namespace, vocab: int
) -> tuple[list[list[int]], list[tuple[ImageItem, ...]] | None, Any]:
    """(our prompts, each one's images, the image processor) for ``args``."""
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    if not args.image_size:
        return prompts, None, None
    from services.engine.vision import load_image_processor

    spec = vision_spec(args.model)
    if spec is None:
        raise SystemExit(f"--image-size needs a vision-language model; {args.model} is not")
    prompts, images = image_prompts(spec, prompts, args.image_size)
    return prompts, images, load_image_processor(model_dir(args.model))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    hf = build_peer(args.model, args.load_format, args.dtype)
    prompts, images, processor = _workload(args, hf.config.get_text_config().vocab_size)
    warm = min(args.batch_size, 4)  # transformers caches nothing between calls: same prompts
    run_hf(hf, prompts[:warm], 4, args.batch_size, images[:warm] if images else None, processor)
    generated: list[int] = []
    try:
        seconds = run_hf(
            hf, prompts, args.output_len, args.batch_size, images, processor, generated
        )
    except torch.OutOfMemoryError:
        return {"batch_size": args.batch_size, "error": "out of memory"}
    total = sum(len(p) for p in prompts) + args.num_prompts * args.output_len
    return {
        "batch_size": args.batch_size,
        "num_prompts": args.num_prompts,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": sum(generated),
        "image_size": args.image_size,
        "seconds": seconds,
        "total_tok_s": total / seconds,
        "dtype": str(next(hf.parameters()).dtype),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
    }


def peer_prompts(args: argparse.Namespace, batch: int) -> int:
    """Prompts the peer times at ``batch``: ``--peer-num-prompts`` rounded up to whole batches,
    at most ``--num-prompts``."""
    want = getattr(args, "peer_num_prompts", None) or args.num_prompts
    return min(args.num_prompts, -(-want // batch) * batch)


def sweep(args: argparse.Namespace, batch_sizes: list[int]) -> dict[str, Any]:
    """One fresh process per batch size; the best one is the peer's figure."""
    runs: dict[str, Any] = {}
    for bs in batch_sizes:
        cmd = [sys.executable, "-m", "services.engine.bench.hf_peer", "--model", args.model,
               "--load-format", args.load_format, "--dtype", args.dtype,
               "--num-prompts", str(peer_prompts(args, bs)), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--batch-size", str(bs)]  # fmt: skip
        if getattr(args, "image_size", None):
            cmd += ["--image-size", str(args.image_size)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            runs[f"bs{bs}"] = {"batch_size": bs, "error": f"timed out after {PEER_TIMEOUT_S:g} s"}
            continue
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            error = "out of memory" if "OutOfMemoryError" in done.stderr else " | ".join(tail)
            runs[f"bs{bs}"] = {"batch_size": bs, "error": error}
        else:
            runs[f"bs{bs}"] = json.loads(lines[-1])
        print(
            f"transformers generate batch {bs} (own process): {_line(runs[f'bs{bs}'])}", flush=True
        )
    timed = [r for r in runs.values() if "seconds" in r]
    best = max(timed, key=lambda r: r["total_tok_s"]) if timed else None
    return {"runs": runs, "best": best}


def _line(run: dict[str, Any]) -> str:
    if "error" in run:
        return str(run["error"])
    return f"{run['seconds']:.2f} s, {run['total_tok_s']:,.0f} total tok/s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--image-size", type=int, default=None)
    args = p.parse_args(argv)
    print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
