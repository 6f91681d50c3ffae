"""``tandem bench offline`` (W1) and ``tandem bench latency`` (W2): the in-process engine.

``--compare-transformers`` times transformers ``generate`` as W1's peer, at its best: each batch
size in its own fresh process (:mod:`services.engine.bench.hf_peer`) before our engine takes the
GPU. ``hf_twin`` (a transformers model on our very weight tensors) serves the GPU parity tests."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch

from kernels.bench.roofline import Ceilings, device_ceilings
from protos.errors import ConfigError
from protos.multimodal import ImageItem
from protos.sampling_params import SamplingParams
from services.engine.bench import hf_peer
from services.engine.bench.hf_peer import random_prompts
from services.engine.llm import config_from_args
from services.engine.llm_engine import LLMEngine
from services.engine.quantization.base import QuantLinear
from services.engine.quantization.fp8 import Fp8Linear

PEER_BATCH_SIZES = (1, 64, 256)  # --compare-transformers without --batch-sizes


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, steps: list | None = None,
    images: list[tuple[ImageItem, ...]] | None = None,
) -> float:  # fmt: skip
    """Seconds to serve every prompt; ``steps`` collects (seconds, tokens, sequences) per step
    (each step ends by reading its sampled tokens, so its wall time covers its GPU work).
    ``images``: each prompt's (placeholders expanded in it), preprocessed and encoded in the
    timed run as a server would."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        pics = images[i] if images is not None else ()
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params, images=pics)
    last = t0
    while engine.has_unfinished:
        engine.step()
        if steps is not None:
            now = time.perf_counter()
            steps.append((now - last, *engine.last_step_shape))
            last = now
    _sync()
    return time.perf_counter() - t0


def image_prompts(
    engine: LLMEngine, prompts: list[list[int]], size: int, seed: int = 0
) -> tuple[list[list[int]], list[tuple[ImageItem, ...]]]:
    """W1 with images (``hf_peer.image_prompts``, which the peer builds its prompts with too)."""
    spec = engine.vision_spec
    if spec is None:
        raise ConfigError(f"--image-size needs a vision-language model; {engine.model_name} is not")
    return hf_peer.image_prompts(spec, prompts, size, seed)


def step_profile(steps: list[tuple[float, int, int]]) -> dict[str, Any]:
    """Where the time went: steps with prompt tokens vs decode-only steps, and the slowest."""
    prefill = [s for s in steps if s[1] > s[2]]
    decode = [s for s in steps if s[1] == s[2]]

    def part(rows: list[tuple[float, int, int]]) -> dict[str, Any]:
        times = sorted(r[0] for r in rows)
        return {"steps": len(rows), "seconds": sum(times), "tokens": sum(r[1] for r in rows),
                "median_ms": 1e3 * times[len(times) // 2] if times else None}  # fmt: skip

    slow = sorted(steps, reverse=True)[:5]
    return {"prefill_or_mixed": part(prefill), "decode_only": part(decode),
            "slowest": [{"ms": 1e3 * t, "tokens": n, "seqs": b} for t, n, b in slow]}  # fmt: skip


def hf_twin(engine: LLMEngine) -> Any:
    """A transformers model whose parameters are views of our engine's (no copy, same weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    files = engine.runner.files
    cfg_path = files.path if files.kind == "named" else (files.hf_dir or files.path) / "config.json"
    raw = json.loads(cfg_path.read_text())
    cfg = AutoConfig.for_model(
        raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"}
    )
    ours = engine.runner.model
    dev, dtype = engine.runner.device, engine.runner.dtype
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    a = engine.runner.arch
    sizes = {
        "q_proj": (0, a.num_heads * a.head_dim),
        "k_proj": (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim),
    }
    sizes["v_proj"] = (sizes["k_proj"][0] + sizes["k_proj"][1], a.num_kv_heads * a.head_dim)
    sizes["gate_proj"] = (0, a.intermediate_size)
    sizes["up_proj"] = (a.intermediate_size, a.intermediate_size)
    ours_p = dict(ours.named_parameters())
    for name, _ in list(hf.named_parameters(remove_duplicate=False)):
        mod_name, _, leaf = name.rpartition(".")
        module = hf.get_submodule(mod_name)
        piece = mod_name.rsplit(".", 1)[-1]
        if piece in sizes:
            fused = "qkv_proj" if piece in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
            src = ours_p[name.replace(piece, fused)]
            start, n = sizes[piece]
            tensor = src.data[start : start + n]
        elif name == "lm_head.weight" and a.tie_word_embeddings:
            tensor = ours_p["model.embed_tokens.weight"].data
        else:
            tensor = ours_p[name].data
        setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))
    rotary = hf.model.rotary_emb
    with torch.device(dev):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    still_meta = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"transformers twin has unfilled tensors: {still_meta[:3]}")
    return hf.eval()


def floor_seconds(
    engine: LLMEngine, n: int, inp: int, out: int, ceilings: Ceilings | None = None
) -> float | None:
    """Napkin floor (targets.md): prefill FLOPs at the GPU's matmul rate + decode bytes at its
    copy bandwidth (``ceilings``, by default :func:`device_ceilings`: 780 TFLOP/s and 3 TB/s on
    an H100); None off a GPU. FP8 layers multiply at twice the bf16 rate (the FP8 tensor cores'
    rate; INT4 ones are dequantized and multiply at the bf16 rate) and a decode step reads the
    weights as they are stored (:func:`_weight_bytes`) and the KV cache in its own dtype."""
    if engine.runner.device.type != "cuda":
        return None
    c = ceilings or device_ceilings()
    a = engine.runner.arch
    rank = getattr(engine.runner, "kv_arch", a)  # this rank's heads (all of them without TP)
    model = engine.runner.model
    embed, _ = _embedding(model, a)  # this rank's rows of it under TP
    fp8 = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Fp8Linear))
    other = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, QuantLinear) and not isinstance(m, Fp8Linear)
    )
    # a token's multiply-adds: the float weights but the embedding table, and the quantized
    params = sum(p.numel() for p in model.parameters()) - embed + other
    if a.moe is not None:  # a token's experts only (a decode step reads every expert picked)
        expert = 3 * a.hidden_size * a.moe.intermediate_size
        params -= len(a.moe.layers) * (a.moe.num_experts - a.moe.top_k) * expert
    attention = 4 * a.num_layers * rank.num_heads * a.head_dim * n * inp * inp / 2
    flops = 2 * params * n * inp + attention + 2 * fp8 * n * inp / 2  # FP8 at twice the rate
    weights = _step_weight_bytes(model, a)
    kv_tok = rank.kv_bytes_per_token(engine.runner.kv_dtype.itemsize)
    decode = sum((weights + n * kv_tok * (inp + s)) for s in range(out - 1))
    return flops / c.bf16_flops_per_s + decode / c.copy_bytes_per_s


def unread_expert_bytes(model: Any, arch: Any, batch: int) -> int:
    """What a decode step of ``batch`` tokens leaves unread of a Mixture-of-Experts model's
    experts: each sparse layer reads only the experts its tokens pick, ``E * (1 - (1 - k/E) **
    batch)`` of them in expectation under uniform routing (dummy weights route so), all of them
    once the batch is large; 0 for a dense model."""
    if arch.moe is None:
        return 0
    e, k = arch.moe.num_experts, arch.moe.top_k
    unread = e * (1 - k / e) ** batch  # experts no token of the step picks
    experts = next((m for n, m in model.named_modules() if n.endswith("mlp.experts")), None)
    if experts is None:
        return 0
    per_layer = sum(p.numel() * p.element_size() for p in experts.parameters())  # all E
    return int(len(arch.moe.layers) * per_layer * unread / e)


def _step_weight_bytes(model: Any, arch: Any) -> int:
    """What a decode step reads of the weights (:func:`_weight_bytes`): all of them but the
    embedding table, of which it reads only its tokens' rows; unless the LM head is that table
    (tied embeddings: SmolLM2, Gemma), which reads all of it."""
    embed, size = _embedding(model, arch)
    table = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    tied = table is not None and getattr(getattr(model, "lm_head", None), "weight", None) is table
    return _weight_bytes(model) - (0 if tied else embed * size)


def _embedding(model: Any, arch: Any) -> tuple[int, int]:
    """(elements, bytes an element) of the embedding table this process holds (a rank's rows
    under TP; a decode step reads only its tokens' rows of it)."""
    weight = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    if weight is None:
        return arch.vocab_size * arch.hidden_size, 2
    return int(weight.numel()), weight.element_size()


def main_offline(args: argparse.Namespace) -> int:
    peer = None
    if args.image_size and hf_peer.vision_spec(args.model) is None:  # before the peer runs
        raise ConfigError(f"--image-size needs a vision-language model; {args.model} is not")
    if args.peer_num_prompts and not args.compare_transformers:
        raise ConfigError(
            "--peer-num-prompts is the transformers peer's: give --compare-transformers"
        )
    if args.batch_sizes is not None and not args.compare_transformers:
        raise ConfigError(
            "--batch-sizes is the transformers peer's (our engine takes every prompt at once): "
            "give --compare-transformers"
        )
    if args.compare_transformers:  # first, while the GPU holds nothing of ours
        peer = hf_peer.sweep(args, args.batch_sizes or list(PEER_BATCH_SIZES))
    engine = LLMEngine(config_from_args(args))
    prompts = random_prompts(args.num_prompts, args.input_len, engine.vocab_size)
    images = None
    if args.image_size:
        warm = random_prompts(1, args.input_len, engine.vocab_size, seed=1)
        warm_ids, warm_images = image_prompts(engine, warm, args.image_size, seed=1)
        run_engine(engine, warm_ids, 4, images=warm_images)  # warm up, the vision tower too
        prompts, images = image_prompts(engine, prompts, args.image_size)
    else:
        run_engine(engine, prompts[: min(4, len(prompts))], 4)  # warm up
    steps: list[tuple[float, int, int]] = []
    before = engine.generation_tokens
    secs = run_engine(engine, prompts, args.output_len, steps, images)
    generated = engine.generation_tokens - before
    total = sum(len(p) for p in prompts) + args.num_prompts * args.output_len
    res: dict[str, Any] = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "device": str(engine.runner.device),
                           "image_size": args.image_size,
                           "prompt_tokens": sum(len(p) for p in prompts),
                           "tandem": {"seconds": secs, "total_tok_s": total / secs,
                                      "output_tokens": generated,
                                      "output_tok_s": args.num_prompts * args.output_len / secs,
                                      "steps": step_profile(steps)}}  # fmt: skip
    mean_prompt = round(sum(len(p) for p in prompts) / len(prompts))  # image tokens included
    floor = floor_seconds(engine, args.num_prompts, mean_prompt, args.output_len)
    if floor:
        res["floor_seconds"], res["fraction_of_floor"] = floor, floor / secs
        res["ceilings"] = dataclasses.asdict(device_ceilings())
    prof = res["tandem"]["steps"]
    print(f"tandem: {secs:.2f} s, {total / secs:,.0f} total tok/s; "
          f"{prof['prefill_or_mixed']['steps']} prefill/mixed steps "
          f"{prof['prefill_or_mixed']['seconds']:.2f} s, {prof['decode_only']['steps']} decode "
          f"steps {prof['decode_only']['seconds']:.2f} s", flush=True)  # fmt: skip
    if peer is not None:
        res["transformers"] = peer  # each batch size in its own fresh process (hf_peer)
        best = peer["best"]
        if best:
            res["speedup_vs_best_transformers"] = (total / secs) / best["total_tok_s"]
            print(f"speedup vs transformers' best (batch {best['batch_size']}, own process): "
                  f"{res['speedup_vs_best_transformers']:.2f}x", flush=True)  # fmt: skip
    _emit(res, args.json_out)
    return 0


def _weight_bytes(model: torch.nn.Module) -> int:
    """What a decode step reads of the model: its parameters and the buffers quantized layers
    keep their packed weights and scales in (the rotary table aside)."""
    tensors: list[torch.Tensor] = list(model.parameters())
    tensors += [  # not the rotary tables (cos_sin, and Gemma's cos_sin_local)
        b for name, b in model.named_buffers() if not name.rpartition(".")[2].startswith("cos_sin")
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def main_latency(args: argparse.Namespace) -> int:
    engine = LLMEngine(config_from_args(args))
    rows = []
    a = engine.runner.arch
    weight_bytes = _step_weight_bytes(engine.runner.model, a)
    ceilings = device_ceilings() if engine.runner.device.type == "cuda" else None
    for bs in args.batch_sizes:
        prompts = random_prompts(bs, args.input_len, engine.vocab_size, seed=bs)
        # every request must still be running while the measured steps run: the early ones keep
        # decoding while later prompts prefill, so give them room for those steps too
        prefill_steps = -(-bs * args.input_len // engine.config.scheduler.token_budget)
        room = engine.max_model_len - args.input_len - 1
        max_tokens = min(room, args.output_len + prefill_steps + 8)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = [f"lat-{bs}-{i}" for i in range(bs)]
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, p, params)
        while any(
            r.num_output_tokens < 2 for r in engine.scheduler.running + engine.scheduler.waiting
        ):
            engine.step()  # prefill everyone first
        times: list[float] = []
        contexts: list[float] = []
        # the time between two steps' returns, with no sync in between: a step may return
        # while the next one already runs on the device (async scheduling), and a sync here
        # would take that overlap away; each return hands out one token per request
        _sync()
        last = time.perf_counter()
        for _ in range(args.output_len):
            running = engine.scheduler.running
            if len(running) != bs:
                break  # not a batch-bs step any more (max-model-len too short for the run)
            contexts.append(sum(r.num_tokens for r in running) / len(running))
            engine.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        _sync()
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished:  # a step launched ahead of the aborts: read, dropped
            engine.step()
        if not times:
            print(f"batch {bs}: no step ran with all {bs} sequences (raise --max-model-len)")
            continue
        times = sorted(times[2:-1]) or sorted(times)
        med = times[len(times) // 2]
        graph_ms = _graph_replay_ms(engine, bs)
        context = sum(contexts) / len(contexts)
        kv = (
            bs * engine.runner.kv_arch.kv_bytes_per_token(engine.runner.kv_dtype.itemsize) * context
        )
        read = weight_bytes - unread_expert_bytes(engine.runner.model, a, bs)
        floor = (read + kv) / ceilings.copy_bytes_per_s if ceilings else None
        rows.append({"batch": bs, "context": args.input_len, "mean_context": context,
                     "steps": len(times), "step_ms": med * 1e3, "graph_replay_ms": graph_ms,
                     "preemptions": engine.scheduler.num_preemptions,
                     "floor_ms": floor * 1e3 if floor else None,
                     "fraction_of_floor": floor / med if floor else None})  # fmt: skip
        print(
            f"batch {bs:4d}: {med * 1e3:8.2f} ms/step"
            + (f"  graph replay {graph_ms:.2f} ms" if graph_ms else "")
            + (f"  floor {floor * 1e3:.2f} ms" if floor else "")
            + f"  ({len(contexts)} steps at batch {bs}, mean context {context:.0f})",
            flush=True,
        )
    res: dict[str, Any] = {"model": args.model, "device": str(engine.runner.device), "rows": rows}
    if ceilings:
        res["ceilings"] = dataclasses.asdict(ceilings)
    _emit(res, args.json_out)
    return 0


def _graph_replay_ms(engine: LLMEngine, batch: int, iters: int = 20) -> float | None:
    """GPU time of one captured decode step (forward + logits) alone, by CUDA events: the step
    time minus this is host work (scheduling, input upload, sampling, output handling). None
    with tensor-parallel ranks: their graphs hold collectives, which rank 0 replaying its own
    alone would wait on forever."""
    graphs = engine.runner.graphs
    b = graphs.bucket(batch) if graphs is not None else None
    if graphs is None or b is None or engine.runner.ranks is not None:
        return None
    graphs.i64[2].fill_(-1)  # the replays write no KV: the blocks belong to nobody now
    graph = graphs.graphs[b][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _emit(res: dict[str, Any], path: str | None) -> None:
    text = json.dumps(res, indent=2)
    if path:
        with open(path, "w") as fh:
            fh.write(text + "\n")
    print(text)
