"""Gateway configuration: flags, worker files, validation with messages that name the knob."""

from __future__ import annotations

import json

import pytest

from gateway.core.config import (
    GatewayConfig,
    WorkerSpec,
    check_topology,
    config_from_args,
    load_worker_file,
)
from protos.roles import Role
from services.cli import build_parser
from services.config import ConfigError


def test_flags_build_the_config(tmp_path) -> None:
    workers = tmp_path / "workers.yaml"
    workers.write_text(
        "decode: ['10.0.0.2:7000']\nworkers:\n  - {role: both, address: '10.0.0.3:7000'}\n"
    )
    args = build_parser().parse_args([
        "gateway", "--prefill", "10.0.0.1:7000", "--decode", "10.0.0.2:7000", "--config", str(workers),
        "--api-key", "k", "--slo-ttft-ms", "200", "--served-model-name", "smol",
    ])  # fmt: skip
    config = config_from_args(args, "/tok")
    assert config.workers == (
        WorkerSpec("prefill", "10.0.0.1:7000"),
        WorkerSpec("decode", "10.0.0.2:7000"),  # listed twice, kept once
        WorkerSpec("colocated", "10.0.0.3:7000"),
    )
    assert (config.api_key, config.slo_ttft_ms, config.model_name) == ("k", 200.0, "smol")


def test_json_worker_file(tmp_path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"prefill": ["h:1"], "worker": ["h:2"]}))
    assert load_worker_file(str(path)) == [
        WorkerSpec("prefill", "h:1"),
        WorkerSpec("colocated", "h:2"),
    ]
    # the role's older spelling "both" still reads as colocated
    path.write_text(json.dumps({"workers": [{"role": "both", "address": "h:3"}]}))
    assert load_worker_file(str(path)) == [WorkerSpec(Role.COLOCATED, "h:3")]


@pytest.mark.parametrize(
    "role, address, words",
    [
        ("gpu", "h:1", "worker role must be one of"),
        ("colocated", "nohost", "HOST:PORT"),
        ("colocated", "h:x", "HOST:PORT"),
        ("prefill", "h:99999", "worker port must be 1-65535, got 'h:99999'"),
        ("decode", "h:0", "worker port must be 1-65535"),
    ],
)
def test_bad_worker_specs(role: str, address: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        WorkerSpec(role, address)


def test_bad_values_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="--request-timeout"):
        GatewayConfig(tokenizer="/t", request_timeout_s=0)
    with pytest.raises(ConfigError, match="--slo-ttft-ms"):
        GatewayConfig(tokenizer="/t", slo_ttft_ms=-1)
    with pytest.raises(ConfigError, match="--local-prefill-queue must be >= 0, got -1"):
        GatewayConfig(tokenizer="/t", local_prefill_queue=-1)
    with pytest.raises(ConfigError, match="--local-prefill-decode-load must be >= 0, got -2"):
        GatewayConfig(tokenizer="/t", local_prefill_decode_load=-2)


def test_conditional_disaggregation_flags_reach_the_config() -> None:
    argv = ["gateway", "--max-local-prefill-tokens", "256", "--local-prefill-queue", "4",
            "--local-prefill-decode-load", "2"]  # fmt: skip
    config = config_from_args(build_parser().parse_args(argv), "/tok")
    assert (config.max_local_prefill_tokens, config.local_prefill_queue) == (256, 4)
    assert config.local_prefill_decode_load == 2
    default = config_from_args(build_parser().parse_args(["gateway"]), "/tok")
    assert (default.max_local_prefill_tokens, default.local_prefill_queue) == (0, 0)


@pytest.mark.parametrize("prefix", ["tandem:", "vllm:", "_", "team:llm_", "A9:"])
def test_metrics_prefix_takes_any_metric_name(prefix: str) -> None:
    assert GatewayConfig(tokenizer="/t", metrics_prefix=prefix).metrics_prefix == prefix


@pytest.mark.parametrize("prefix", ["", "1bad", "vllm-", "tandem.", "my prefix:", "é:"])
def test_a_bad_metrics_prefix_is_a_config_error(prefix: str) -> None:
    with pytest.raises(ConfigError, match="--metrics-prefix must be a Prometheus metric name"):
        GatewayConfig(tokenizer="/t", metrics_prefix=prefix)


def test_metrics_prefix_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["gateway", "--metrics-prefix", "vllm:"])
    assert config_from_args(args, "/tok").metrics_prefix == "vllm:"
    default = build_parser().parse_args(["gateway"])
    assert config_from_args(default, "/tok").metrics_prefix == "tandem:"


def test_tandem_gateway_with_a_bad_prefix_exits_2_without_a_traceback(
    tmp_path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    argv = ["gateway", "--tokenizer", str(tmp_path), "--metrics-prefix", "1bad"]
    assert main(argv) == 2  # before anything is loaded or bound
    assert "--metrics-prefix must be a Prometheus metric name" in caplog.text
    assert "'1bad'" in caplog.text
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out + caplog.text


def test_send_timeout_flag_reaches_the_config_and_zero_is_none() -> None:
    default = build_parser().parse_args(["gateway"])
    assert config_from_args(default, "/tok").send_timeout_s == 60.0
    args = build_parser().parse_args(["gateway", "--send-timeout", "0"])
    assert config_from_args(args, "/tok").send_timeout_s == 0.0
    with pytest.raises(ConfigError, match="--send-timeout must be"):
        GatewayConfig(tokenizer="/t", send_timeout_s=-1.0)


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_a_negative_send_timeout_exits_2_with_a_message(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--send-timeout", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--send-timeout" in err and "'-1'" in err and "Traceback" not in err


def test_limit_mm_per_prompt_reads_vllms_json() -> None:
    args = build_parser().parse_args(["gateway", "--limit-mm-per-prompt", '{"image": 2}'])
    assert config_from_args(args, "/tok").limit_mm_per_prompt == 2
    default = build_parser().parse_args(["gateway"])
    assert config_from_args(default, "/tok").limit_mm_per_prompt is None


@pytest.mark.parametrize(
    ("value", "limit"),
    [('{"image": 2, "video": 0}', 2), ('{"image": {"count": 3}}', 3), ('{"audio": 0}', None),
     ('{"image": 0, "video": {"count": 0}}', 0)],
)  # fmt: skip
def test_limit_mm_per_prompt_takes_vllms_other_forms(value: str, limit: int | None) -> None:
    """vLLM's way to turn video off beside images, and its {"count": N} form."""
    args = build_parser().parse_args(["gateway", "--limit-mm-per-prompt", value])
    assert config_from_args(args, "/tok").limit_mm_per_prompt == limit


@pytest.mark.parametrize(
    ("value", "words"),
    [("image=2", "must be JSON"), ('{"video": 1}', "takes only an image limit"),
     ('{"image": -1}', "count >= 0"), ('{"image": true}', "count >= 0"),
     ('{"image": 2, "video": 1}', "takes only an image limit"), ("[2]", "JSON object"),
     ('{"image": {"count": 2, "width": 512}}', "only count"),
     ('{"video": {"count": 1}}', "takes only an image limit"),
     ('{"images": 2}', "unknown modality 'images'")],
)  # fmt: skip
def test_a_bad_limit_mm_per_prompt_is_a_config_error(
    tmp_path, caplog: pytest.LogCaptureFixture, value: str, words: str
) -> None:
    from services.cli import main

    argv = ["gateway", "--tokenizer", str(tmp_path), "--limit-mm-per-prompt", value]
    assert main(argv) == 2
    assert words in caplog.text


def test_image_url_fetching_is_off_by_default_and_its_flags_reach_the_config() -> None:
    default = config_from_args(build_parser().parse_args(["gateway"]), "/tok")
    assert default.allowed_media_domains == () and not default.media_allow_http
    assert (default.media_fetch_timeout_s, default.media_max_bytes) == (5.0, 20 * 1024 * 1024)
    argv = ["gateway", "--allowed-media-domains", "Img.Example.COM.", "*.cdn.net", "[::1]",
            "--media-allow-http", "--media-fetch-timeout", "2.5", "--media-max-bytes", "1000"]  # fmt: skip
    config = config_from_args(build_parser().parse_args(argv), "/tok")
    assert config.allowed_media_domains == ("img.example.com", "*.cdn.net", "::1")
    assert config.media_allow_http
    assert (config.media_fetch_timeout_s, config.media_max_bytes) == (2.5, 1000)


@pytest.mark.parametrize(
    "domain", ["https://img.example.com", "img.example.com:443", "example.com/images", "",
               "a.*.com", "u@example.com", "bücher.de"],
)  # fmt: skip
def test_an_allowed_media_domain_that_is_not_a_host_is_a_config_error(domain: str) -> None:
    with pytest.raises(ConfigError, match="--allowed-media-domains takes host names"):
        GatewayConfig(tokenizer="/t", allowed_media_domains=(domain,))


@pytest.mark.parametrize("flag", ["--media-fetch-timeout", "--media-max-bytes"])
def test_a_media_limit_that_is_not_positive_exits_2(flag: str) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["gateway", flag, "0"])
    assert e.value.code == 2


def test_worker_stall_timeout_reaches_the_config_and_a_bad_one_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    default = config_from_args(build_parser().parse_args(["gateway"]), "/tok")
    assert default.worker_stall_timeout_s == 10.0
    args = build_parser().parse_args(["gateway", "--worker-stall-timeout", "2.5"])
    assert config_from_args(args, "/tok").worker_stall_timeout_s == 2.5
    for command in ("gateway", "up"):
        for bad in ("0", "-1", "nan", "inf", "soon"):
            with pytest.raises(SystemExit) as e:
                build_parser().parse_args([command, "--worker-stall-timeout", bad])
            assert e.value.code == 2
            err = capsys.readouterr().err
            assert "--worker-stall-timeout" in err and repr(bad) in err, err
    with pytest.raises(ConfigError, match="--worker-stall-timeout must be a finite number"):
        GatewayConfig(tokenizer="/t", worker_stall_timeout_s=0)


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("w.yaml", "prefill: [a\n  b: :\n", r"w.yaml is not valid YAML: .* \(line 2, column 4\)"),
        ("w.json", '{"worker": ["h:1"],', "w.json is not valid JSON"),
        ("w.yaml", "foo: 1\ncolocated: ['h:1']\n",
         "unknown key\\(s\\) 'foo', 'colocated'; the keys are prefill, decode, worker, workers"),
        ("w.yaml", "decode: h:1\n", "'decode' must be a list"),
    ],
)  # fmt: skip
def test_a_bad_worker_file_is_a_one_line_config_error(
    tmp_path, name: str, text: str, words: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        load_worker_file(str(path))
    assert "\n" not in str(info.value)


def test_a_missing_worker_file_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read it \\(No such file or directory\\)"):
        load_worker_file(str(tmp_path / "nothing.yaml"))


def _workers(*specs: tuple[str, str]) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(Role.parse(role), address) for role, address in specs)


@pytest.mark.parametrize(
    "workers",
    [
        _workers(("colocated", "h:1")),
        _workers(("prefill", "h:1"), ("decode", "h:2")),
        _workers(("prefill", "h:1"), ("colocated", "h:2")),
    ],
)
def test_a_topology_that_can_serve_passes(workers: tuple[WorkerSpec, ...]) -> None:
    check_topology(GatewayConfig(tokenizer="/t", workers=workers))


@pytest.mark.parametrize(
    ("workers", "words"),
    [
        ((), "no workers: give --worker HOST:PORT"),
        (_workers(("prefill", "h:1")), "prefill workers but no decode worker.*--decode HOST:PORT"),
        (_workers(("decode", "h:1")), "decode workers but no prefill worker.*--prefill HOST:PORT"),
    ],
)
def test_a_topology_that_cannot_serve_is_refused_naming_the_missing_role(
    workers: tuple[WorkerSpec, ...], words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        check_topology(GatewayConfig(tokenizer="/t", workers=workers))


def test_with_discovery_any_start_is_valid() -> None:
    """Discovered lists change as pods come and go: nothing to refuse at start."""
    from gateway.core.config import DiscoverySpec

    discover = (DiscoverySpec.parse("decode=decode.svc:50051"),)
    check_topology(GatewayConfig(tokenizer="/t", discover=discover))
    prefill_only = _workers(("prefill", "h:1"))
    check_topology(GatewayConfig(tokenizer="/t", workers=prefill_only, discover=discover))


def test_the_api_key_is_the_flag_then_tandem_api_key_then_vllm_api_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def key(*flags: str) -> str | None:
        return config_from_args(build_parser().parse_args(["gateway", *flags]), "/tok").api_key

    for name in ("TANDEM_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert key() is None  # no key anywhere: the API is open
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")  # a vLLM setup: the gateway stays closed
    assert key() == "from-vllm"
    monkeypatch.setenv("TANDEM_API_KEY", "")  # set but empty (compose's default): not a key
    assert key() == "from-vllm"
    monkeypatch.setenv("TANDEM_API_KEY", "from-tandem")
    assert key() == "from-tandem"
    assert key("--api-key", "from-flag") == "from-flag"


@pytest.mark.parametrize("flag", ["", "  "])
def test_an_empty_api_key_flag_is_refused_not_taken_as_no_key(
    flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--api-key ""`` (an unset shell variable expanded, say) opened the API without a word;
    an empty variable stays "not set" (compose passes TANDEM_API_KEY on empty by default)."""
    monkeypatch.setenv("TANDEM_API_KEY", "")
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    args = build_parser().parse_args(["gateway", "--api-key", flag])
    with pytest.raises(ConfigError, match="give a non-empty key, or leave the flag out"):
        config_from_args(args, "/tok")


def test_cors_is_vllms_default_any_origin_method_and_header_without_credentials() -> None:
    config = config_from_args(build_parser().parse_args(["gateway"]), "/tok")
    cors = (config.allowed_origins, config.allowed_methods, config.allowed_headers)
    assert cors == (("*",), ("*",), ("*",))
    assert config.allow_credentials is False


def test_cors_flags_take_vllms_json_lists() -> None:
    args = build_parser().parse_args([
        "gateway", "--allowed-origins", '["https://app.example.com", "http://localhost:3000"]',
        "--allowed-methods", '["post", "GET"]', "--allowed-headers", '["Authorization"]',
        "--allow-credentials",
    ])  # fmt: skip
    config = config_from_args(args, "/tok")
    assert config.allowed_origins == ("https://app.example.com", "http://localhost:3000")
    assert config.allowed_methods == ("POST", "GET")  # as browsers send them
    assert config.allowed_headers == ("Authorization",)
    assert config.allow_credentials is True
    none = build_parser().parse_args(
        ["gateway", "--allowed-origins", "[]", "--no-allow-credentials"]
    )
    assert config_from_args(none, "/tok").allowed_origins == ()
    assert none.allow_credentials is False


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--allowed-origins", "https://app.example.com", "takes a JSON list of strings such as"),
        ("--allowed-origins", "['*']", "takes a JSON list of strings such as"),
        ("--allowed-origins", '"*"', "takes a JSON list of strings, got '*'"),
        ("--allowed-origins", '{"origin": "*"}', "takes a JSON list of strings"),
        ("--allowed-origins", "[1]", "got 1 in it"),
        ("--allowed-origins", '["https://app.example.com/"]', "without a path or a trailing"),
        ("--allowed-origins", '["app.example.com"]', "is not an origin"),
        ("--allowed-methods", '["PO ST"]', "is not an HTTP method"),
        ("--allowed-headers", '["X-Key:"]', "is not a header name"),
    ],
)
def test_a_bad_cors_flag_exits_2_naming_it_without_a_traceback(
    flag: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    for command in ("gateway", "up"):
        with pytest.raises(SystemExit) as exc:
            main([command, flag, value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"tandem {command}: error: argument {flag}: " in err and words in err, err
        assert "Traceback" not in err


def test_a_cors_list_built_in_code_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"--allowed-origins: 'example\.com' is not an origin"):
        GatewayConfig(tokenizer="/tok", allowed_origins=("example.com",))
    assert GatewayConfig(tokenizer="/tok", allowed_methods=("get",)).allowed_methods == ("GET",)


def test_default_chat_template_kwargs_reach_the_config() -> None:
    """vLLM's --default-chat-template-kwargs: a JSON object of template variables."""
    flag = ["--default-chat-template-kwargs", '{"enable_thinking": false, "x": [1]}']
    args = build_parser().parse_args(["gateway", *flag])
    kwargs = config_from_args(args, "/tok").default_chat_template_kwargs
    assert kwargs == {"enable_thinking": False, "x": [1]}
    assert config_from_args(build_parser().parse_args(["gateway"]), "/tok").default_chat_template_kwargs == {}  # fmt: skip


@pytest.mark.parametrize(
    ("value", "words"),
    [("{nope", "is not valid JSON"), ("[1]", "must be a JSON object"),
     ('{"tools": []}', "tools cannot have a server default"),
     ('{"add_generation_prompt": false, "messages": []}', "messages, add_generation_prompt")],
)  # fmt: skip
def test_bad_default_chat_template_kwargs_are_a_config_error(value: str, words: str) -> None:
    args = build_parser().parse_args(["gateway", "--default-chat-template-kwargs", value])
    with pytest.raises(ConfigError, match=words):
        config_from_args(args, "/tok")
