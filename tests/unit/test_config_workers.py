"""The data-plane worker count: the table of Rust's own ``test_parse_worker_threads``
(istio/ztunnel src/config.rs), pinning ``get_cpu_count``, ``default_worker_threads`` and
``parse_worker_threads``."""

from __future__ import annotations

import pytest

from ztunnel.config import Config, ConfigError, available_cpus, cpu_count, worker_threads

pytestmark = pytest.mark.timeout(10)


def four() -> int:
    return 4


@pytest.mark.parametrize(
    ("env", "concurrency", "want"),
    [
        # parse_worker_threads: a fixed number, percentages of the CPU count (rounded up, >= 1)
        ({"ZTUNNEL_WORKER_THREADS": "4"}, None, 4),
        ({"ZTUNNEL_CPU_LIMIT": "8", "ZTUNNEL_WORKER_THREADS": "50%"}, None, 4),
        ({"ZTUNNEL_CPU_LIMIT": "16", "ZTUNNEL_WORKER_THREADS": "30%"}, None, 5),
        ({"ZTUNNEL_CPU_LIMIT": "4", "ZTUNNEL_WORKER_THREADS": "10%"}, None, 1),
        # 0 means every CPU
        ({"ZTUNNEL_WORKER_THREADS": "0", "ZTUNNEL_CPU_LIMIT": "6"}, None, 6),
        # the variable wins over the proxy config's concurrency
        ({"ZTUNNEL_WORKER_THREADS": "3"}, 7, 3),
        # concurrency > 0 is used as is; 0 is every CPU
        ({}, 7, 7),
        ({"ZTUNNEL_CPU_LIMIT": "6"}, 0, 6),
        # default_worker_threads: an explicit resource limit wins (the request raises it)
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "16"}, None, 16),
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "1"}, None, 1),
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "500m"}, None, 1),
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "2500m"}, None, 3),
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "1.5"}, None, 2),
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "16", "ZTUNNEL_RESOURCE_CPU_REQUEST": "4"}, None, 16),
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "4", "ZTUNNEL_RESOURCE_CPU_REQUEST": "8"}, None, 8),
        # otherwise 25% of the CPUs, floored at the request and at 2
        ({"ZTUNNEL_CPU_LIMIT": "32"}, None, 8),
        ({}, None, 2),  # 25% of 4 CPUs is 1: the floor of 2
        ({"ZTUNNEL_RESOURCE_CPU_REQUEST": "8"}, None, 8),
        ({"ZTUNNEL_RESOURCE_CPU_REQUEST": "1"}, None, 2),
    ],
)
def test_worker_threads(env: dict[str, str], concurrency: int | None, want: int) -> None:
    assert worker_threads(env, concurrency, four) == want


def test_cpu_count_order() -> None:
    # Rust get_cpu_count: the resource limit, then ZTUNNEL_CPU_LIMIT, then the CPUs we may use
    assert cpu_count({}, four) == 4
    assert cpu_count({"ZTUNNEL_CPU_LIMIT": "12"}, four) == 12
    assert cpu_count({"ZTUNNEL_CPU_LIMIT": "12", "ZTUNNEL_RESOURCE_CPU_LIMIT": "3"}, four) == 3


@pytest.mark.parametrize(
    "env",
    [
        {"ZTUNNEL_WORKER_THREADS": "many"},
        {"ZTUNNEL_WORKER_THREADS": "0%"},
        {"ZTUNNEL_WORKER_THREADS": "101%"},
        {"ZTUNNEL_WORKER_THREADS": "-1"},
        {"ZTUNNEL_RESOURCE_CPU_LIMIT": "0"},
        {"ZTUNNEL_RESOURCE_CPU_LIMIT": "lots"},
        {"ZTUNNEL_CPU_LIMIT": "1.5"},
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as e:
        worker_threads(env, None, four)
    assert e.value.var in env


def test_available_cpus_honours_the_cgroup_quota(tmp_path: object) -> None:
    from pathlib import Path

    p = Path(str(tmp_path)) / "cpu.max"
    p.write_text("150000 100000\n")
    assert available_cpus(str(p)) == min(2, available_cpus("/nonexistent"))
    p.write_text("max 100000\n")
    assert available_cpus(str(p)) == available_cpus("/nonexistent")


def test_config_from_env() -> None:
    assert Config.from_env({"ZTUNNEL_WORKER_THREADS": "3"}).num_worker_threads == 3
    assert Config().num_worker_threads == 1  # (a Config built in code runs one process)


def test_worker_recycling_knobs() -> None:
    # Python-only (workers/recycle.py): no Rust counterpart.
    cfg = Config.from_env({})
    assert cfg.worker_recycle_growth == 8 << 20
    assert cfg.worker_recycle_interval.total_seconds() == 30
    cfg = Config.from_env(
        {"ZTUNNEL_WORKER_RECYCLE_MIB": "0", "ZTUNNEL_WORKER_RECYCLE_INTERVAL": "500ms"}
    )
    assert cfg.worker_recycle_growth == 0  # never
    assert cfg.worker_recycle_interval.total_seconds() == 0.5
    for env in (
        {"ZTUNNEL_WORKER_RECYCLE_MIB": "-1"},
        {"ZTUNNEL_WORKER_RECYCLE_MIB": "lots"},
        {"ZTUNNEL_WORKER_RECYCLE_INTERVAL": "0s"},
    ):
        with pytest.raises(ConfigError) as e:
            Config.from_env(env)
        assert e.value.var in env
