"""The configuration dataclasses' validation: ``--task`` and ``--pooler-config``."""

from __future__ import annotations

import pytest

from protos.roles import Role
from services.config import ConfigError, EngineConfig, PoolerConfig, SpeculativeConfig, WorkerConfig


def test_the_pooler_defaults_are_vllms_for_a_causal_lm() -> None:
    assert PoolerConfig.parse(None) == PoolerConfig("last", True) == EngineConfig().pooler


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"pooling_type": "MEAN"}', PoolerConfig("mean", True)),
        ('{"pooling_type": "cls", "normalize": false}', PoolerConfig("cls", False)),
        ({"normalize": False}, PoolerConfig("last", False)),
    ],
)
def test_pooler_configs_parse(text: str | dict, expected: PoolerConfig) -> None:
    assert PoolerConfig.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"pooling_type": "MAX"}', "pooling_type must be one of last, mean, cls"),
        ('{"pooling_type": 1}', "pooling_type must be a string"),
        ('{"normalize": "yes"}', "normalize must be true or false"),
        ('{"dimensions": 64}', "not supported: dimensions"),
    ],
)
def test_bad_pooler_configs_are_refused_naming_the_problem(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        PoolerConfig.parse(text)


def test_tasks_are_checked() -> None:
    with pytest.raises(ConfigError, match="--task must be one of generate, embed"):
        EngineConfig(task="classify")
    with pytest.raises(ConfigError, match="does not apply to --task embed"):
        EngineConfig(task="embed", speculative=SpeculativeConfig())


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_only_a_colocated_worker_embeds(role: Role) -> None:
    with pytest.raises(ConfigError, match="--task embed is served by a colocated worker"):
        WorkerConfig(role=role, engine=EngineConfig(task="embed"), worker_id="w")
    WorkerConfig(role=Role.COLOCATED, engine=EngineConfig(task="embed"), worker_id="w")


def test_lora_flags_become_a_lora_config_or_a_clear_refusal() -> None:
    from services.cli import build_parser
    from services.config import ConfigError, LoRAConfig
    from services.engine.llm import config_from_args

    def config(*flags: str) -> LoRAConfig | None:
        args = build_parser().parse_args(["worker", "--port", "0", *flags])
        return config_from_args(args).lora

    assert config() is None
    lora = config("--enable-lora", "--lora-modules", "sql=/a/sql", "--max-loras", "3")
    assert lora == LoRAConfig(modules=(("sql", "/a/sql"),), max_loras=3, max_lora_rank=16)
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        config("--lora-modules", "sql=/a/sql")
    with pytest.raises(ConfigError, match="--allow-runtime-lora-updating needs --enable-lora"):
        config("--allow-runtime-lora-updating")
    with pytest.raises(ConfigError, match="NAME=PATH entries, got 'sql'"):
        config("--enable-lora", "--lora-modules", "sql")
    with pytest.raises(ConfigError, match="names an adapter twice: a"):
        config("--enable-lora", "--lora-modules", "a=/x", "a=/y")
    assert config("--enable-lora", "--tensor-parallel-size", "2") is not None
    # vLLM's JSON form of an entry, beside NAME=PATH ones
    entry = '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}'
    lora = config("--enable-lora", "--lora-modules", "sql=/a/sql", entry)
    assert lora is not None and lora.modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert lora.base_models == (("chat", "base"),)  # checked against the served names
    with pytest.raises(ConfigError, match="base_model_name 'base' is not the model served"):
        lora.check_names("/m/llama", "llama")
    lora.check_names("/m/llama", "base")
    for bad, words in (('{"name": "x"}', 'needs "path"'), ('{"path": "/p"}', 'needs "name"'),
                       ('{"name": "x", "path": "/p", "id": 1}', "not supported: id"),
                       ('{"name": "x", "path": "/p", "base_model_name": 1}', "must be a string"),
                       ('{"name": "x",', "not valid JSON")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            config("--enable-lora", "--lora-modules", bad)
    with pytest.raises(ConfigError, match=r"--allow-runtime-lora-updating .* with --tensor-para"):
        config("--enable-lora", "--allow-runtime-lora-updating", "--tensor-parallel-size", "2")


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"kv_cache_gib": float("nan")}, "--kv-cache-gib must be a positive, finite"),
        ({"kv_cache_gib": float("inf")}, "--kv-cache-gib must be a positive, finite"),
        ({"kv_cache_gib": 0.0}, "--kv-cache-gib must be a positive, finite"),
        ({"kv_offloading_gib": float("nan")}, "--kv-offloading-size must be >= 0"),
        ({"kv_offloading_gib": float("inf")}, "--kv-offloading-size must be >= 0"),
    ],
)
def test_kv_sizes_that_are_not_finite_positive_numbers_are_refused(kw: dict, words: str) -> None:
    """NaN and infinity passed the old `<= 0` checks and crashed the block plan with a
    traceback (cannot convert float NaN to integer)."""
    from services.config import CacheConfig

    with pytest.raises(ConfigError, match=words):
        CacheConfig(**kw)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"max_num_seqs": 65537}, r"--max-num-seqs must be in \[1, 65536\], got 65537"),
        ({"max_num_seqs": 10**9}, r"--max-num-seqs must be in \[1, 65536\]"),
        ({"max_num_seqs": 0}, r"--max-num-seqs must be in \[1, 65536\]"),
        ({"max_num_batched_tokens": 2**20 + 1}, r"--max-num-batched-tokens must be in \[1, 104"),
        ({"max_num_batched_tokens": 0}, r"--max-num-batched-tokens must be in \[1, 1048576\]"),
    ],
)
def test_batch_limits_past_what_the_engine_sizes_buffers_for_are_refused(
    kw: dict, words: str
) -> None:
    """The offline API builds this config without the CLI: --max-num-seqs 10**9 was an
    allocation failure's traceback when the engine sized its step buffers."""
    from services.config import SchedulerConfig

    with pytest.raises(ConfigError, match=words):
        SchedulerConfig(**kw)
    edge = {k: 2**16 if k == "max_num_seqs" else 2**20 for k in kw}
    assert SchedulerConfig(**edge) is not None  # the bounds themselves are taken
