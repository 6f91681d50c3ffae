from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from deploy.plan import (
    Plan,
    Worker,
    assign_gpus,
    build_plan,
    fill_plan,
    fill_utilization,
    gateway_spec,
    with_flag,
)
from deploy.supervisor import ChildSpec
from services.cli import build_parser
from services.config import ConfigError

PROGRAM = ("python", "-m", "services.cli")


def up(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *flags])


def plan_for(
    *flags: str, gpus: tuple[str, ...] = (), cpus: int = 2, env: dict | None = None
) -> Plan:
    return build_plan(up(*flags), list(gpus), cpus, Path("/run"), PROGRAM, env or {})


def reparse(argv: list[str]) -> argparse.Namespace:
    assert argv[: len(PROGRAM)] == list(PROGRAM)
    return build_parser().parse_args(argv[len(PROGRAM) :])


def by_name(plan: Plan) -> dict[str, tuple[str, dict[str, str]]]:
    return {w.spec.name: (w.role, w.spec.env) for w in plan.workers}


def test_default_is_one_prefill_and_one_decode_on_loopback_free_ports() -> None:
    plan = plan_for()
    assert [(w.spec.name, w.role) for w in plan.workers] == [
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
    ]
    for worker in plan.workers:
        args = reparse(worker.spec.argv)
        assert args.command == worker.role
        assert (args.host, args.port, args.device) == ("127.0.0.1", 0, "cpu")
        assert args.worker_id == worker.spec.name
        assert (
            Path(args.ready_file) == worker.spec.ready_file == Path(f"/run/{worker.spec.name}.json")
        )
    assert plan.summary() == "gateway + 1 prefill + 1 decode"
    assert plan.prepare_argv[1:] == ["-m", "deploy.prepare", "--model", "embedded"]


def test_cpu_cores_are_split_between_workers() -> None:
    assert {env["OMP_NUM_THREADS"] for _, env in by_name(plan_for(cpus=2)).values()} == {"1"}
    assert {env["OMP_NUM_THREADS"] for _, env in by_name(plan_for(cpus=16)).values()} == {"8"}
    assert by_name(plan_for("--prefill", "3", "--decode", "2", cpus=2))["decode-1"][1] == {
        "OMP_NUM_THREADS": "1"
    }


def test_a_thread_count_the_user_set_is_respected() -> None:
    plan = plan_for(env={"OMP_NUM_THREADS": "7"})
    assert all("OMP_NUM_THREADS" not in w.spec.env for w in plan.workers)


def test_engine_flags_the_user_set_reach_every_worker() -> None:
    flags = ["--model", "llama-3.1-8b", "--load-format", "dummy", "--max-model-len", "512"]
    flags += ["--no-enable-prefix-caching", "--enforce-eager", "--block-size", "32"]
    flags += ["--max-num-seqs", "16", "--kv-cache-gib", "0.5", "--dtype", "float32"]
    for worker in plan_for(*flags).workers:
        args = reparse(worker.spec.argv)
        assert args.model == "llama-3.1-8b" and args.load_format == "dummy"
        assert (args.max_model_len, args.block_size, args.max_num_seqs) == (512, 32, 16)
        assert args.enable_prefix_caching is False and args.enforce_eager is True
        assert (args.kv_cache_gib, args.dtype) == (0.5, "float32")


def test_kv_checksum_reaches_the_prefill_workers_only() -> None:
    for worker in plan_for("--kv-checksum", "--prefill", "2").workers:
        args = reparse(worker.spec.argv)
        assert getattr(args, "kv_checksum", None) is (True if worker.role == "prefill" else None)
    assert all("--kv-checksum" not in w.spec.argv for w in plan_for().workers)


def test_engine_stall_timeout_reaches_every_worker() -> None:
    for colocated in ((), ("--colocated", "2")):
        plan = plan_for("--engine-stall-timeout", "45", *colocated)
        assert [reparse(w.spec.argv).engine_stall_timeout for w in plan.workers] == [45.0] * len(
            plan.workers
        )
        assert "--engine-stall-timeout" not in plan.gateway_argv
    for worker in plan_for().workers:  # the workers' own default
        assert "--engine-stall-timeout" not in worker.spec.argv
        assert reparse(worker.spec.argv).engine_stall_timeout == 120.0


def test_kv_streaming_off_reaches_the_prefill_workers_only() -> None:
    for worker in plan_for("--kv-streaming", "off", "--prefill", "2").workers:
        args = reparse(worker.spec.argv)
        assert getattr(args, "kv_streaming", None) == ("off" if worker.role == "prefill" else None)
    for worker in plan_for().workers:  # by device by default, in tandem up and in the workers
        assert "--kv-streaming" not in worker.spec.argv
        assert getattr(reparse(worker.spec.argv), "kv_streaming", "auto") == "auto"


@pytest.mark.parametrize(
    "flag", ["--max-local-prefill-tokens", "--local-prefill-queue", "--local-prefill-decode-load"]
)
def test_conditional_disaggregation_is_the_gateways_setting(flag: str) -> None:
    plan = plan_for(flag, "256")
    at = plan.gateway_argv.index(flag)

    assert plan.gateway_argv[at + 1] == "256"
    assert all(flag not in w.spec.argv for w in plan.workers)
    assert flag not in plan_for().gateway_argv


def _queue(plan: Plan, flag: str = "--local-prefill-queue") -> int:
    argv = plan.gateway_argv
    return int(argv[argv.index(flag) + 1]) if flag in argv else 0


def test_prefill_and_decode_on_one_gpu_prefill_locally_while_prefill_is_busy() -> None:
    """The queue rule defaults on where each decode worker shares its GPU with a prefill worker
    (measured: the pair's goodput at 8 req/s of 4096-token prompts on one H200, 0.15x colocated
    without it, 0.84x with it) and off where decode has a GPU of its own or on the CPU; what the
    user sets wins."""
    assert _queue(plan_for(gpus=("0",))) == 1
    assert _queue(plan_for("--prefill", "2", "--decode", "2", gpus=("0",))) == 1
    assert _queue(plan_for(gpus=("0", "1"))) == 0  # decode on a GPU of its own
    assert _queue(plan_for()) == 0  # the CPU
    assert _queue(plan_for("--colocated", "1", gpus=("0",))) == 0  # no decode worker
    assert _queue(plan_for("--local-prefill-queue", "0", gpus=("0",))) == 0
    assert _queue(plan_for("--local-prefill-queue", "3", gpus=("0", "1"))) == 3
    assert all("--local-prefill-queue" not in w.spec.argv for w in plan_for(gpus=("0",)).workers)


def test_prefill_and_decode_on_one_gpu_prefill_locally_while_decode_is_busy() -> None:
    """The decode-load rule defaults on where each decode worker shares its GPU with a prefill
    worker and off elsewhere, as the queue rule; what the user sets wins."""
    flag = "--local-prefill-decode-load"
    assert _queue(plan_for(gpus=("0",)), flag) == 1
    assert _queue(plan_for("--prefill", "2", "--decode", "2", gpus=("0",)), flag) == 1
    assert _queue(plan_for(gpus=("0", "1")), flag) == 0  # decode on a GPU of its own
    assert _queue(plan_for(), flag) == 0  # the CPU
    assert _queue(plan_for("--colocated", "1", gpus=("0",)), flag) == 0
    assert _queue(plan_for(flag, "0", gpus=("0",)), flag) == 0
    assert _queue(plan_for(flag, "4", gpus=("0", "1")), flag) == 4


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--tool-call-parser", "nope", "--enable-auto-tool-choice"],
            "--tool-call-parser must be one of",
        ),
        (["--reasoning-parser", "nope"], "--reasoning-parser must be one of"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
        (["--drain-timeout", "-5"], "--drain-timeout must be"),
        (["--drain-timeout", "nan"], "--drain-timeout must be"),
        (["--metrics-prefix", "9bad"], "--metrics-prefix must be a Prometheus metric name"),
    ],
)
def test_gateway_flags_are_checked_before_any_model_loads(flags: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        plan_for(*flags)


def test_tool_and_reasoning_parsers_go_to_the_gateway() -> None:
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--reasoning-parser", "qwen3")  # fmt: skip
    plan = plan_for(*flags)
    argv = plan.gateway_argv
    assert "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert all(f not in w.spec.argv for w in plan.workers for f in flags)
    assert not {"--tool-call-parser", "--enable-auto-tool-choice"} & set(plan_for().gateway_argv)


def test_generation_config_flags_go_to_the_gateway_only(tmp_path: Path) -> None:
    override = '{"temperature": 0.5}'
    plan = plan_for("--generation-config", str(tmp_path), "--override-generation-config", override)
    argv = plan.gateway_argv
    assert argv[argv.index("--generation-config") + 1] == str(tmp_path)
    assert argv[argv.index("--override-generation-config") + 1] == override
    assert reparse(argv).override_generation_config == override
    assert all("generation-config" not in " ".join(w.spec.argv) for w in plan.workers)
    assert "--generation-config" not in plan_for().gateway_argv  # auto: the gateway's default
    assert "--generation-config" in plan_for("--generation-config", "vllm").gateway_argv


def test_the_image_limit_goes_to_the_gateway_only() -> None:
    plan = plan_for("--limit-mm-per-prompt", '{"image": 2}')
    argv = plan.gateway_argv
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image": 2}'
    assert all("--limit-mm-per-prompt" not in w.spec.argv for w in plan.workers)
    assert "--limit-mm-per-prompt" not in plan_for().gateway_argv


def test_image_url_fetching_flags_go_to_the_gateway_only() -> None:
    plan = plan_for("--allowed-media-domains", "a.example.com", "*.cdn.net", "--media-allow-http",
                    "--media-fetch-timeout", "2", "--media-max-bytes", "1000")  # fmt: skip
    args = reparse(plan.gateway_argv)
    assert args.allowed_media_domains == ["a.example.com", "*.cdn.net"]
    assert args.media_allow_http
    assert (args.media_fetch_timeout, args.media_max_bytes) == (2.0, 1000)
    media = ("--allowed-media-domains", "--media-allow-http", "--media-fetch-timeout",
             "--media-max-bytes")  # fmt: skip
    assert not any(f in w.spec.argv for w in plan.workers for f in media)
    assert not any(f in plan_for().gateway_argv for f in media)  # defaults: nothing to pass


def test_the_body_limit_goes_to_the_gateway_only() -> None:
    """tandem up takes --max-body-bytes: an image sent inline (base64, 4/3 of its size) past
    the gateway's 4 MiB default could otherwise never be served."""
    plan = plan_for("--max-body-bytes", str(32 << 20))
    assert reparse(plan.gateway_argv).max_body_bytes == 32 << 20
    assert not any("--max-body-bytes" in w.spec.argv for w in plan.workers)
    assert "--max-body-bytes" not in plan_for().gateway_argv  # the default: nothing to pass


def test_the_responses_store_bounds_go_to_the_gateway_only() -> None:
    plan = plan_for("--responses-store-size", "0", "--responses-store-max-bytes", "4096")
    args = reparse(plan.gateway_argv)
    assert args.responses_store_size == 0 and args.responses_store_max_bytes == 4096
    assert not any("--responses-store" in f for w in plan.workers for f in w.spec.argv)
    assert not any("--responses-store" in f for f in plan_for().gateway_argv)  # defaults


def test_cors_flags_go_to_the_gateway_only_as_the_json_it_reads() -> None:
    plan = plan_for("--allowed-origins", '["https://app.example.com"]', "--allowed-methods",
                    '["POST"]', "--allowed-headers", "[]", "--allow-credentials")  # fmt: skip
    args = reparse(plan.gateway_argv)
    assert args.allowed_origins == ["https://app.example.com"]
    assert (args.allowed_methods, args.allowed_headers) == (["POST"], [])
    assert args.allow_credentials
    cors = ("--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials")
    assert not any(f in w.spec.argv for w in plan.workers for f in cors)
    assert not any(f in plan_for().gateway_argv for f in cors)  # vLLM's defaults: nothing to pass
    default = reparse(plan_for().gateway_argv)
    assert default.allowed_origins == default.allowed_methods == default.allowed_headers == ["*"]


def test_a_bad_allowed_media_domain_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match="--allowed-media-domains takes host names"):
        plan_for("--allowed-media-domains", "https://a.example.com")


def test_default_engine_flags_are_left_out_of_the_command_line() -> None:
    argv = plan_for().workers[0].spec.argv
    assert (
        "--block-size" not in argv
        and "--model" not in argv
        and "--enable-prefix-caching" not in argv
    )


def test_two_gpus_put_prefill_and_decode_on_different_gpus() -> None:
    plan = plan_for(gpus=("0", "1"))
    workers = by_name(plan)
    assert workers["prefill-0"][1] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert workers["decode-0"][1] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert all(reparse(w.spec.argv).device == "cuda" for w in plan.workers)
    assert all(reparse(w.spec.argv).gpu_memory_utilization == 0.9 for w in plan.workers)


def test_roles_never_share_a_gpu_when_there_are_two_and_sharers_split_memory() -> None:
    plan = plan_for("--prefill", "2", "--decode", "2", gpus=("0", "1"))
    gpus = {w.spec.name: w.gpus for w in plan.workers}
    assert gpus == {
        "prefill-0": ("0",),
        "prefill-1": ("0",),
        "decode-0": ("1",),
        "decode-1": ("1",),
    }
    assert {reparse(w.spec.argv).gpu_memory_utilization for w in plan.workers} == {0.45}


def test_gpus_are_shared_out_in_proportion_to_the_roles() -> None:
    placed = assign_gpus(["prefill", "decode", "decode", "decode"], ["0", "1", "2", "3"])
    assert placed == [("0",), ("1",), ("2",), ("3",)]
    placed = assign_gpus(["prefill"] * 3 + ["decode"], [str(i) for i in range(8)])
    assert placed[-1] == ("6",) and set(placed[:3]) <= {(str(i),) for i in range(6)}


def test_one_gpu_is_shared_with_lower_memory_utilization_each() -> None:
    plan = plan_for(gpus=("0",))
    assert [w.gpus for w in plan.workers] == [("0",), ("0",)]
    assert {reparse(w.spec.argv).gpu_memory_utilization for w in plan.workers} == {0.45}


def test_a_shared_gpu_caps_the_prefill_pool_and_starts_decode_after_it() -> None:
    prefill, decode = plan_for(gpus=("0",)).workers
    assert reparse(prefill.spec.argv).max_total_tokens == 4 * 8192  # 4 steps of the GPU default
    assert reparse(decode.spec.argv).max_total_tokens is None
    assert (prefill.fill_after, decode.fill_after, decode.fill_share) == ((), ("prefill-0",), 1)
    steps = plan_for("--max-num-batched-tokens", "2048", gpus=("0",)).workers[0]
    assert reparse(steps.spec.argv).max_total_tokens == 4 * 2048
    # never less than a full step beside a block for each seat: the warm-up's largest step runs
    wide = plan_for("--block-size", "128", gpus=("0",)).workers[0]
    assert reparse(wide.spec.argv).max_total_tokens == 8192 + 256 * 128


@pytest.mark.parametrize(
    "flags",
    [
        ("--gpu-memory-utilization", "0.8"),
        ("--kv-cache-gib", "10"),
        ("--num-blocks", "1000"),
        ("--max-total-tokens", "50000"),
    ],
)
def test_a_user_sized_pool_is_left_as_given_on_a_shared_gpu(flags: tuple[str, str]) -> None:
    prefill, decode = plan_for(*flags, gpus=("0",)).workers
    assert not decode.fill_after
    given = reparse(prefill.spec.argv).max_total_tokens
    assert given == (50000 if flags[0] == "--max-total-tokens" else None)


def test_no_fill_without_sharing_or_on_the_cpu() -> None:
    for plan in (plan_for(gpus=("0", "1")), plan_for(), plan_for("--colocated", "2", gpus=("0",))):
        assert not any(w.fill_after for w in plan.workers)
        assert all(reparse(w.spec.argv).max_total_tokens is None for w in plan.workers)


def test_fill_plan_counts_the_decode_workers_of_the_most_shared_gpu() -> None:
    roles = ["prefill", "prefill", "decode", "decode", "decode"]
    placement = [("0",), ("1",), ("0",), ("0",), ("1",)]
    names = ["p0", "p1", "d0", "d1", "d2"]
    assert fill_plan(roles, placement, names) == {
        2: (("p0",), 2),
        3: (("p0",), 2),
        4: (("p1",), 1),
    }
    assert fill_plan(["prefill", "decode"], [(), ()], ["p", "d"]) == {}  # the CPU


def _worker(name: str, role: str, gpus: tuple[str, ...], after=(), share=1) -> Worker:
    return Worker(ChildSpec(name, []), role, gpus, after, share)


def test_fill_utilization_is_what_the_prefill_workers_leave_of_the_ceiling() -> None:
    p0, p1 = _worker("p0", "prefill", ("0",)), _worker("p1", "prefill", ("0",))
    d = _worker("d", "decode", ("0",), ("p0", "p1"), 2)
    ready = {
        "p0": {"gpu_bytes": 20, "gpu_total_bytes": 100},
        "p1": {"gpu_bytes": 10, "gpu_total_bytes": 100},
    }
    assert fill_utilization(d, [p0, p1, d], ready) == 0.3  # (0.9 - 0.3) / 2
    ready["p1"] = {"port": 1}  # a worker that reported no figures: keep the plan's split
    assert fill_utilization(d, [p0, p1, d], ready) is None
    ready["p1"] = {"gpu_bytes": 75, "gpu_total_bytes": 100}  # nothing left: said, not hidden
    assert fill_utilization(d, [p0, p1, d], ready) == -0.025


def test_fill_utilization_takes_the_least_over_the_workers_gpus() -> None:
    a, b = _worker("a", "prefill", ("0",)), _worker("b", "prefill", ("1",))
    d = _worker("d", "decode", ("0", "1"), ("a", "b"))
    ready = {
        "a": {"gpu_bytes": 25, "gpu_total_bytes": 100},
        "b": {"gpu_bytes": 47, "gpu_total_bytes": 100},
    }
    assert fill_utilization(d, [a, b, d], ready) == 0.43  # GPU 1: 0.9 - 0.47


def test_with_flag_replaces_or_adds() -> None:
    argv = ["x", "--gpu-memory-utilization", "0.45", "--port", "0"]
    assert with_flag(argv, "--gpu-memory-utilization", "0.7") == [
        "x", "--gpu-memory-utilization", "0.7", "--port", "0"
    ]  # fmt: skip
    assert with_flag(["x"], "--gpu-memory-utilization", "0.7")[-2:] == [
        "--gpu-memory-utilization", "0.7"
    ]  # fmt: skip


def test_an_explicit_memory_utilization_is_kept_even_when_sharing() -> None:
    plan = plan_for("--gpu-memory-utilization", "0.3", gpus=("0",))
    assert {reparse(w.spec.argv).gpu_memory_utilization for w in plan.workers} == {0.3}


def test_colocated_workers_round_robin_over_gpus() -> None:
    plan = plan_for("--colocated", "3", gpus=("0", "1"))
    assert [(w.spec.name, w.role, w.gpus) for w in plan.workers] == [
        ("worker-0", "worker", ("0",)),
        ("worker-1", "worker", ("1",)),
        ("worker-2", "worker", ("0",)),
    ]
    assert plan.summary() == "gateway + 3 colocated"


def test_tensor_parallel_workers_get_several_gpus_each() -> None:
    plan = plan_for("--tensor-parallel-size", "2", gpus=("0", "1", "2", "3"))
    assert [w.spec.env["CUDA_VISIBLE_DEVICES"] for w in plan.workers] == ["0,1", "2,3"]


def test_too_few_gpus_for_tensor_parallelism_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="needs 2 GPUs per worker"):
        plan_for("--tensor-parallel-size", "2", gpus=("0",))


def test_device_cpu_ignores_gpus() -> None:
    plan = plan_for("--device", "cpu", gpus=("0", "1"))
    assert all("CUDA_VISIBLE_DEVICES" not in w.spec.env for w in plan.workers)
    assert {reparse(w.spec.argv).device for w in plan.workers} == {"cpu"}


def test_zero_workers_of_a_role_is_refused() -> None:
    with pytest.raises(ConfigError, match="--colocated"):
        plan_for("--decode", "0")


def test_gateway_points_at_the_ports_the_workers_reported() -> None:
    plan = plan_for("--prefill", "2", "--port", "8123", "--host", "0.0.0.0", "--api-key", "k")
    ports = {"prefill-0": 5001, "prefill-1": 5002, "decode-0": 5003}
    spec = gateway_spec(plan, ports, "/cache/model")
    args = reparse(spec.argv)
    assert args.command == "gateway"
    assert args.prefill == ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert args.decode == ["127.0.0.1:5003"]
    assert (args.host, args.port, args.tokenizer) == ("0.0.0.0", 8123, "/cache/model")
    assert "k" not in spec.argv and spec.env == {"TANDEM_API_KEY": "k"}  # not visible in `ps`
    assert Path(args.ready_file) == spec.ready_file
    assert spec.stop_tier < plan.workers[0].spec.stop_tier  # the gateway stops first


def test_colocated_gateway_uses_worker_targets() -> None:
    plan = plan_for("--colocated", "2")
    args = reparse(gateway_spec(plan, {"worker-0": 1, "worker-1": 2}, None).argv)
    assert (
        args.worker == ["127.0.0.1:1", "127.0.0.1:2"]
        and args.prefill == []
        and args.tokenizer is None
    )


@pytest.mark.parametrize(("flags", "drain"), [((), 30.0), (("--drain-timeout", "45"), 45.0)])
def test_the_gateway_gets_the_drain_timeout_the_launcher_waits_for(
    flags: tuple[str, ...], drain: float
) -> None:
    from deploy.launcher import DRAIN_MARGIN_S, shutdown_grace

    plan = plan_for(*flags)
    spec = gateway_spec(plan, {"prefill-0": 1, "decode-0": 2}, None)
    assert reparse(spec.argv).drain_timeout == plan.drain_timeout_s == drain
    assert spec.stop_tier < min(w.spec.stop_tier for w in plan.workers)  # gateway first
    # SIGKILL only after the gateway's whole drain, so streams end with finish_reason and [DONE]
    assert shutdown_grace(plan.drain_timeout_s, floor_s=15.0) == drain + DRAIN_MARGIN_S
    assert shutdown_grace(plan.drain_timeout_s, floor_s=drain + 60) == drain + 60  # env floor


@pytest.mark.parametrize(("flags", "stall"), [((), 10.0), (("--worker-stall-timeout", "3"), 3.0)])
def test_the_gateway_gets_the_worker_stall_timeout(flags: tuple[str, ...], stall: float) -> None:
    plan = plan_for(*flags)
    spec = gateway_spec(plan, {"prefill-0": 1, "decode-0": 2}, None)
    assert reparse(spec.argv).worker_stall_timeout == stall
    assert all("--worker-stall-timeout" not in w.spec.argv for w in plan.workers)


@pytest.mark.parametrize(
    ("flags", "prefix"), [((), "tandem:"), (("--metrics-prefix", "vllm:"), "vllm:")]
)
def test_the_gateway_gets_the_metrics_prefix(flags: tuple[str, ...], prefix: str) -> None:
    """tandem up --metrics-prefix vllm: serves vLLM's series names, which vLLM's dashboards and
    benchmark clients' server-metric summaries (aiperf's KV usage, cache hit rate) look for."""
    plan = plan_for(*flags)
    spec = gateway_spec(plan, {"prefill-0": 1, "decode-0": 2}, None)
    assert reparse(spec.argv).metrics_prefix == prefix
    assert all("--metrics-prefix" not in w.spec.argv for w in plan.workers)


@pytest.mark.parametrize(("flags", "send"), [((), 60.0), (("--send-timeout", "0"), 0.0)])
def test_the_gateway_gets_the_send_timeout(flags: tuple[str, ...], send: float) -> None:
    plan = plan_for(*flags)
    spec = gateway_spec(plan, {"prefill-0": 1, "decode-0": 2}, None)
    assert reparse(spec.argv).send_timeout == send
    assert all("--send-timeout" not in w.spec.argv for w in plan.workers)


def test_task_embed_and_the_pooler_reach_the_colocated_workers() -> None:
    pooler = '{"pooling_type": "MEAN"}'
    plan = plan_for("--colocated", "2", "--task", "embed", "--pooler-config", pooler)
    for worker in plan.workers:
        args = reparse(worker.spec.argv)
        assert (args.task, args.pooler_config) == ("embed", pooler)
    for worker in plan_for("--colocated", "1").workers:  # generate, the default, goes unsaid
        assert "--task" not in worker.spec.argv and "--pooler-config" not in worker.spec.argv


def test_task_embed_in_a_disaggregated_topology_is_refused() -> None:
    with pytest.raises(ConfigError, match="--task embed is served by colocated workers"):
        plan_for("--task", "embed")


def test_prefill_and_decode_may_differ_in_tensor_parallel_size() -> None:
    """Each role's own flag reaches its workers (the KV hand-off regroups the heads); with
    GPUs, every worker gets as many distinct ones as it has ranks."""
    flags = ("--prefill-tensor-parallel-size", "2", "--decode", "2")
    plan = plan_for(*flags, gpus=("0", "1", "2", "3"))
    tp = {w.spec.name: reparse(w.spec.argv).tensor_parallel_size for w in plan.workers}
    assert tp == {"prefill-0": 2, "decode-0": 1, "decode-1": 1}
    assert [w.gpus for w in plan.workers] == [("0", "1"), ("2",), ("3",)]
    cpu = plan_for("--decode-tensor-parallel-size", "2", "--tensor-parallel-size", "3")
    assert [reparse(w.spec.argv).tensor_parallel_size for w in cpu.workers] == [3, 2]
    assert all(w.gpus == () for w in cpu.workers)
    # on the CPU the cores are split between ranks (each rank's process inherits the setting)
    cores = plan_for("--prefill-tensor-parallel-size", "3", cpus=16)
    assert [w.spec.env["OMP_NUM_THREADS"] for w in cores.workers] == ["4", "4"]


def test_a_workers_ranks_never_share_a_gpu() -> None:
    plan = plan_for("--decode-tensor-parallel-size", "2", "--prefill", "2", gpus=("0", "1", "2"))
    assert all(len(set(w.gpus)) == len(w.gpus) for w in plan.workers)
    with pytest.raises(ConfigError, match="needs 4 GPUs per worker but only 3"):
        plan_for("--decode-tensor-parallel-size", "4", gpus=("0", "1", "2"))


def test_role_tensor_parallel_sizes_are_refused_for_colocated_workers() -> None:
    with pytest.raises(ConfigError, match="colocated ones take --tensor-parallel-size"):
        plan_for("--colocated", "1", "--decode-tensor-parallel-size", "2")


def _adapter_dirs(root: Path, *names: str) -> list[str]:
    for name in names:
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text("{}")
        (root / name / "adapter_model.safetensors").write_bytes(b"")
    return [f"{name}={root / name}" for name in names]


def test_lora_flags_reach_every_worker_and_parse_there(tmp_path: Path) -> None:
    modules = _adapter_dirs(tmp_path, "a", "b")
    plan = plan_for("--enable-lora", "--lora-modules", *modules, "--max-loras", "2",
                    "--allow-runtime-lora-updating")  # fmt: skip
    assert {w.role for w in plan.workers} == {"prefill", "decode"}
    for w in plan.workers:
        args = reparse(w.spec.argv)
        assert args.enable_lora and args.allow_runtime_lora_updating
        assert args.lora_modules == modules and args.max_loras == 2


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--lora-modules", "a=/no/such/adapter"), "'a': /no/such/adapter is not a peft adapter"),
        (
            ("--decode-tensor-parallel-size", "2", "--allow-runtime-lora-updating"),
            "--allow-runtime-lora-updating (adapters loaded at run time) with",
        ),
        (  # the gateway takes the base model's names for the base model
            ("--served-model-name", "chat", "--lora-modules", "chat=/ad/chat"),
            "--lora-modules name 'chat' is the base model's name",
        ),
        (
            ("--model", "/m/base", "--lora-modules", "/m/base=/ad/chat"),
            "--lora-modules name '/m/base' is the base model's name",
        ),
        (  # the embedded model is served as SmolLM2-135M-Instruct: that name is the base's too
            ("--lora-modules", "SmolLM2-135M-Instruct=/ad/chat"),
            "--lora-modules name 'SmolLM2-135M-Instruct' is the base model's name",
        ),
        (  # vLLM's JSON entry naming a base model other than the one served
            (
                "--served-model-name",
                "chat",
                "--lora-modules",
                '{"name": "sql", "path": "/ad/sql", "base_model_name": "llama"}',
            ),
            "--lora-modules entry 'sql': base_model_name 'llama' is not the model served",
        ),
    ],
)
def test_lora_that_no_worker_could_serve_is_refused_before_any_starts(
    flags: tuple[str, ...], words: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        plan_for("--enable-lora", *flags)


def test_a_json_entry_naming_the_served_model_as_its_base_is_served(tmp_path: Path) -> None:
    (entry,) = _adapter_dirs(tmp_path, "sql")
    name, path = entry.split("=")
    module = json.dumps({"name": name, "path": path, "base_model_name": "SmolLM2-135M-Instruct"})
    plan = plan_for("--enable-lora", "--lora-modules", module)  # the name the embedded model has
    assert all(reparse(w.spec.argv).lora_modules == [module] for w in plan.workers)
    for base in ("chat", "/m/base"):  # --served-model-name or --model
        module = json.dumps({"name": name, "path": path, "base_model_name": base})
        plan = plan_for("--model", "/m/base", "--served-model-name", "chat", "--enable-lora",
                        "--lora-modules", module)  # fmt: skip
        assert all(reparse(w.spec.argv).lora_modules == [module] for w in plan.workers)


def test_a_bad_image_limit_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match="--limit-mm-per-prompt must be JSON"):
        plan_for("--limit-mm-per-prompt", "{bad")


def test_lora_modules_without_enable_lora_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        plan_for("--lora-modules", "a=/ad/a")


def test_cuda_visible_devices_on_a_machine_without_gpus_plans_cpu_workers() -> None:
    from deploy.gpus import detect_gpus

    env = {"CUDA_VISIBLE_DEVICES": "0"}
    gpus = detect_gpus(None, env, lambda: None, driver=lambda: False, note=lambda _: None)
    plan = plan_for("--colocated", "1", gpus=tuple(gpus), env=env)
    assert {reparse(w.spec.argv).device for w in plan.workers} == {"cpu"}
    assert all("CUDA_VISIBLE_DEVICES" not in w.spec.env for w in plan.workers)


def test_the_gateway_gets_the_chat_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's serve --chat-template: tandem up passes it to the gateway, a file made absolute
    (a relative one named from where tandem up ran), a template given inline as it is."""
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    monkeypatch.chdir(tmp_path)
    spec = gateway_spec(
        plan_for("--chat-template", "t.jinja"), {"prefill-0": 1, "decode-0": 2}, None
    )
    assert reparse(spec.argv).chat_template == str(tmp_path / "t.jinja")
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    spec = gateway_spec(plan_for("--chat-template", inline), {"prefill-0": 1, "decode-0": 2}, None)
    assert reparse(spec.argv).chat_template == inline
    plan = plan_for()
    assert "--chat-template" not in gateway_spec(plan, {"prefill-0": 1, "decode-0": 2}, None).argv
    assert all("--chat-template" not in w.spec.argv for w in plan.workers)


def test_several_served_model_names_reach_the_gateway_and_guard_adapter_names() -> None:
    """vLLM's `--served-model-name a b`: the gateway gets both (it serves each); an adapter may
    not take the second name either."""
    plan = plan_for("--served-model-name", "smol", "gpt-3.5-turbo")
    assert reparse(plan.gateway_argv).served_model_name == ["smol", "gpt-3.5-turbo"]
    with pytest.raises(ConfigError, match=re.escape("name 'gpt-3.5-turbo' is the base")):
        plan_for("--enable-lora", "--served-model-name", "smol", "gpt-3.5-turbo",
                 "--lora-modules", "gpt-3.5-turbo=/ad/x")  # fmt: skip


def test_the_gateway_gets_the_default_chat_template_kwargs() -> None:
    """tandem up passes vLLM's --default-chat-template-kwargs to the gateway (the workers
    render nothing), and a bad value ends tandem up before anything starts."""
    value = '{"enable_thinking": false}'
    plan = plan_for("--default-chat-template-kwargs", value)
    spec = gateway_spec(plan, {"prefill-0": 1, "decode-0": 2}, None)
    assert reparse(spec.argv).default_chat_template_kwargs == value
    assert all("--default-chat-template-kwargs" not in w.spec.argv for w in plan.workers)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        plan_for("--default-chat-template-kwargs", "[]")


def test_request_limits_and_slo_targets_go_to_the_gateway_only() -> None:
    """tandem up takes the gateway's --request-timeout, --header-timeout, --body-timeout,
    --max-connections and SLO targets (it refused them: a topology it started could not change
    them, the image's default command included) and hands the gateway those given."""
    flags = {"--request-timeout": "30", "--header-timeout": "5", "--body-timeout": "20",
             "--max-connections": "64", "--slo-ttft-ms": "250", "--slo-tpot-ms": "20"}  # fmt: skip
    plan = plan_for(*(w for pair in flags.items() for w in pair))
    args = reparse(plan.gateway_argv)
    assert (args.request_timeout, args.header_timeout, args.body_timeout) == (30.0, 5.0, 20.0)
    assert (args.max_connections, args.slo_ttft_ms, args.slo_tpot_ms) == (64, 250.0, 20.0)
    assert not any(f in w.spec.argv for w in plan.workers for f in flags)
    assert not any(f in plan_for().gateway_argv for f in flags)  # the defaults: nothing to pass


@pytest.mark.parametrize(
    "flags",
    [["--request-timeout", "0"], ["--max-connections", "0"], ["--slo-ttft-ms", "nan"],
     ["--max-body-bytes", "0"], ["--max-body-bytes", "-1"]],
)  # fmt: skip
def test_bad_gateway_limits_are_refused_by_tandem_up_itself(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 at parse time, before any model loads (--max-body-bytes 0 was refused only by the
    gateway, once the workers had loaded)."""
    with pytest.raises(SystemExit) as exc:
        up(*flags)
    assert exc.value.code == 2
    assert f"argument {flags[0]}: expected" in capsys.readouterr().err


def test_speculative_decoding_reaches_the_workers_that_decode_only() -> None:
    """A prefill worker decodes nothing; given --speculative-config it loaded the draft model
    and its KV cache for nothing (the decode worker catches its own draft up on the prompt)."""
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    plan = plan_for("--speculative-config", spec, "--decode", "2")
    for worker in plan.workers:
        args = reparse(worker.spec.argv)
        assert args.speculative_config == (None if worker.role == "prefill" else spec), worker
    (colocated,) = plan_for("--speculative-config", spec, "--colocated", "1").workers
    assert reparse(colocated.spec.argv).speculative_config == spec


def test_a_pooler_config_without_task_embed_is_refused_not_ignored() -> None:
    mean = '{"pooling_type": "MEAN"}'
    with pytest.raises(ConfigError, match="--pooler-config is for --task embed"):
        plan_for("--pooler-config", mean, "--colocated", "1")
    (worker,) = plan_for("--pooler-config", mean, "--colocated", "1", "--task", "embed").workers
    assert reparse(worker.spec.argv).pooler_config == mean


@pytest.mark.parametrize(
    "topology", [[], ["--colocated", "2"], ["--prefill", "2", "--decode", "1"]]
)
def test_the_otlp_endpoint_reaches_the_gateway_and_every_worker(topology: list[str]) -> None:
    """tandem up refused --otlp-endpoint, so the topology it started exported no traces unless
    OTEL_EXPORTER_OTLP_ENDPOINT was exported first. The gateway takes the flag; the workers
    read the variables (the traces' own too, so the flag wins as it does in the gateway)."""
    endpoint = "http://collector:4317"
    plan = plan_for(*topology, "--otlp-endpoint", endpoint)
    assert reparse(plan.gateway_argv).otlp_endpoint == endpoint
    assert plan.workers and all(
        w.spec.env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
        and w.spec.env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == endpoint
        and "--otlp-endpoint" not in w.spec.argv  # no worker takes the flag
        for w in plan.workers
    )
    for w in plan.workers:  # a worker's command line parses, with its environment beside it
        reparse(w.spec.argv)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in plan.gateway_env
    bare = plan_for(*topology)  # not given: nothing set, the launcher's environment decides
    assert "--otlp-endpoint" not in bare.gateway_argv
    assert not any(k.startswith("OTEL_") for w in bare.workers for k in w.spec.env)
