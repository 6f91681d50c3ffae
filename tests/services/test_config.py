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
