"""W1's transformers peer: each batch size in its own process, the best one reported."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.cli import build_parser
from services.engine.bench import hf_peer

pytestmark = pytest.mark.timeout(300)


def test_each_batch_size_runs_in_its_own_process_and_the_best_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2's published config, only smaller (each process draws its random weights): the
    suite's time."""
    from services import model_files

    raw = json.loads(model_files.resolve_model("smollm2-135m").path.read_text())
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(raw | SHRINK))
    spawned: list[list[str]] = []
    real_run = hf_peer.subprocess.run

    def run(cmd: list[str], **kwargs: object):  # type: ignore[no-untyped-def]
        spawned.append(cmd)
        return real_run(cmd, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(hf_peer.subprocess, "run", run)
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    args = argparse.Namespace(
        model=str(tmp_path / "tiny"), load_format="dummy", dtype="auto",
        num_prompts=4, input_len=16, output_len=3,
    )  # fmt: skip
    out = hf_peer.sweep(args, [1, 4])
    assert [cmd[cmd.index("--batch-size") + 1] for cmd in spawned] == ["1", "4"]
    runs = out["runs"]
    assert set(runs) == {"bs1", "bs4"}
    for bs, run_ in ((1, runs["bs1"]), (4, runs["bs4"])):
        assert run_["batch_size"] == bs and run_["seconds"] > 0
        assert run_["total_tok_s"] == pytest.approx(4 * (16 + 3) / run_["seconds"])
    assert out["best"] == max(runs.values(), key=lambda r: r["total_tok_s"])


def test_a_failing_peer_is_reported_not_raised() -> None:
    # the peer process exits non-zero on an input length that is no number, before it imports
    # torch and transformers (a bad dtype failed the same way ~7 s of CPU later)
    args = argparse.Namespace(
        model="smollm2-135m", load_format="dummy", dtype="auto",
        num_prompts=2, input_len="no_such_length", output_len=2,
    )  # fmt: skip
    out = hf_peer.sweep(args, [2])
    assert out["best"] is None and "no_such_length" in out["runs"]["bs2"]["error"]


def test_only_the_offline_benchmark_takes_compare_transformers() -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "offline", "--compare-transformers"]).compare_transformers
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["bench", "latency", "--compare-transformers"])
    assert info.value.code == 2


def _offline(tmp_path: Path, model: str, *extra: str) -> dict[str, Any]:
    from services.engine.bench.in_process import main_offline

    out = tmp_path / "w1.json"
    argv = ["bench", "offline", "--model", model, "--load-format", "dummy", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "3", "--json-out", str(out), *extra]  # fmt: skip
    assert main_offline(build_parser().parse_args(argv)) == 0
    return json.loads(out.read_text())


def _check_peer_run(res: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """The peer timed the first 2 of our 4 prompts (--peer-num-prompts), the same ids (so the
    same token count), and generated every requested token; the best is that run."""
    run_ = res["transformers"]["runs"]["bs2"]
    assert run_["num_prompts"] == 2 and run_["output_tokens"] == 2 * 3
    assert run_["prompt_tokens"] == prompt_tokens
    assert run_["total_tok_s"] == pytest.approx((prompt_tokens + 2 * 3) / run_["seconds"])
    assert res["transformers"]["best"] == run_
    assert res["speedup_vs_best_transformers"] == pytest.approx(
        res["tandem"]["total_tok_s"] / run_["total_tok_s"]
    )
    return run_


def test_a_qwen3_moe_model_runs_w1_beside_its_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22's W1 side by side, tiny: our engine and transformers' Qwen3MoeForCausalLM from
    the same config, random weights, the peer in its own process."""
    from tests.services.engine.conftest import tiny_checkpoint

    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    tiny_checkpoint(
        tmp_path / "moe", "qwen3_moe", hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    res = _offline(tmp_path, str(tmp_path / "moe"), "--compare-transformers", "--batch-sizes",
                   "2", "--peer-num-prompts", "2")  # fmt: skip
    assert res["prompt_tokens"] == 4 * 8 and res["tandem"]["output_tokens"] == 4 * 3
    run_ = _check_peer_run(res, 2 * 8)
    assert run_["experts_implementation"] is not None  # transformers' MoE path, recorded


def test_a_vl_model_runs_w1_with_images_beside_its_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26's W1 with one image per prompt, tiny: the peer (Qwen2VLForConditionalGeneration
    in its own process) gets the same ids with the same placeholders and the same images."""
    from tests.services.vl_model import build

    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    build(tmp_path / "vl")
    res = _offline(tmp_path, str(tmp_path / "vl"), "--image-size", "56", "--compare-transformers",
                   "--batch-sizes", "2", "--peer-num-prompts", "2")  # fmt: skip
    # 8 text tokens + vision start and end + 4 image tokens (56x56: 2x2 merged patches)
    assert res["prompt_tokens"] == 4 * 14 and res["tandem"]["output_tokens"] == 4 * 3
    assert _check_peer_run(res, 2 * 14)["image_size"] == 56


# the published configs' own keys and layout (flat text keys, rope_scaling type mrope, in_chans),
# only the sizes shrunk to run on a CPU
SHRINK = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
SHRINK_MOE = {**SHRINK, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
              "num_experts_per_tok": 2}  # fmt: skip
SHRINK_VL = {**SHRINK, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
SHRINK_VISION = {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64}
# Qwen3-VL's published layout: the text keys under text_config, DeepStack from both blocks
SHRINK_V3_TEXT = {**SHRINK, "head_dim": 16, "rope_scaling": {
    "mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"}}  # fmt: skip
SHRINK_V3_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                    "out_hidden_size": 64, "deepstack_visual_indexes": [0, 1]}  # fmt: skip
# a 56x56 image's tokens: Qwen2-VL's min_pixels keep it at 2x2 merged patches, Qwen3-VL's
# (256x256) scale it up to 8x8
IMAGE_TOKENS = {"qwen2-vl-7b": 4, "qwen3-vl-8b": 64}


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen2-vl-7b", "qwen3-vl-8b"])
def test_the_published_configs_shrunk_run_in_our_engine_and_the_peer(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The named configs as published (the VL ones directories with their
    preprocessor_config.json), only smaller: our engine and the peer read them alike, and count the same prompt tokens
    (the same ids, the VL one with the same placeholders for its 56x56 images)."""
    from services import model_files

    files = model_files.resolve_model(name)
    raw = json.loads(files.path.read_text())
    configs = tmp_path / "configs"
    if name in IMAGE_TOKENS:
        if name == "qwen2-vl-7b":
            raw |= SHRINK_VL
            raw["vision_config"] |= SHRINK_VISION
        else:
            raw["text_config"] |= SHRINK_V3_TEXT
            raw["vision_config"] |= SHRINK_V3_VISION
        (configs / "tiny").mkdir(parents=True)
        shutil.copy(files.path.parent / "preprocessor_config.json", configs / "tiny")
        (configs / "tiny" / "config.json").write_text(json.dumps(raw))
        extra = ["--image-size", "56"]
    else:
        configs.mkdir()
        (configs / "tiny.json").write_text(json.dumps(raw | SHRINK_MOE))
        extra = []
    monkeypatch.setattr(model_files, "NAMED_CONFIGS_DIR", configs)
    ours = _offline(tmp_path, "tiny", *extra)
    assert ours["tandem"]["output_tokens"] == 4 * 3
    # each prompt's image tokens between vision start and end
    assert ours["prompt_tokens"] == 4 * (8 + (IMAGE_TOKENS[name] + 2 if extra else 0))
    argv = ["--model", "tiny", "--load-format", "dummy", "--num-prompts", "4", "--input-len", "8",
            "--output-len", "3", "--batch-size", "4", *extra]  # fmt: skip
    assert hf_peer.main(argv) == 0
    peer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert peer["prompt_tokens"] == ours["prompt_tokens"] and peer["output_tokens"] == 4 * 3


def test_the_peer_times_whole_batches_of_the_first_prompts() -> None:
    args = argparse.Namespace(num_prompts=256, peer_num_prompts=64)
    assert [hf_peer.peer_prompts(args, bs) for bs in (16, 48, 64, 128, 512)] == [
        64, 96, 64, 128, 256,
    ]  # fmt: skip
    args.peer_num_prompts = None
    assert hf_peer.peer_prompts(args, 64) == 256


def test_w1_refuses_what_it_cannot_measure_before_the_peer_runs(tmp_path: Path) -> None:
    from services.config import ConfigError
    from services.engine.bench.in_process import main_offline

    def run(*extra: str) -> None:
        argv = ["bench", "offline", "--model", "smollm2-135m", "--num-prompts", "2", *extra]
        main_offline(build_parser().parse_args(argv))

    with pytest.raises(ConfigError, match="--image-size needs a vision-language model"):
        run("--image-size", "448", "--compare-transformers")
    with pytest.raises(ConfigError, match="give --compare-transformers"):
        run("--peer-num-prompts", "2")


def test_a_batch_size_out_of_memory_is_recorded_and_the_sweep_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 30B MoE shape leaves transformers ~15 GB of an 80 GB GPU: a large batch runs out of
    memory in its process (the traceback names it) and the next batch size still runs."""

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        bs = int(cmd[cmd.index("--batch-size") + 1])
        if bs == 64:
            return subprocess.CompletedProcess(
                cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory"
            )
        line = json.dumps({"batch_size": bs, "seconds": 2.0, "total_tok_s": 100.0})
        return subprocess.CompletedProcess(cmd, 0, line + "\n", "")

    monkeypatch.setattr(hf_peer.subprocess, "run", run)
    args = argparse.Namespace(
        model="qwen3-30b-a3b", load_format="dummy", dtype="bfloat16",
        num_prompts=256, input_len=1024, output_len=128, peer_num_prompts=64,
    )  # fmt: skip
    out = hf_peer.sweep(args, [64, 32])
    assert out["runs"]["bs64"] == {"batch_size": 64, "error": "out of memory"}
    assert out["best"] == out["runs"]["bs32"] and out["best"]["batch_size"] == 32
