"""EngineConfig: validation names the parameter and value; argv and mapping round trips."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError, UnknownSwitch


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"batch": 0}, "batch"),
        ({"kv": "fp8"}, "kv"),
        ({"device": "gpu0"}, "device"),
        ({"context": 300000}, "context"),
        ({"kv_resident": 10000, "context": 4096}, "kv_resident"),
        ({"vram_reserve_mib": -1}, "vram_reserve_mib"),
        ({"port": 70000}, "port"),
        ({"peer_device": "cpu"}, "peer_device"),
        ({"prefill_chunk_tokens": 8192, "step_token_budget": 4096}, "prefill_chunk_tokens"),
        ({"batch": True}, "batch"),
    ],
)
def test_invalid_option_names_param_and_value(kwargs: dict, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**kwargs)
    assert info.value.param == param
    assert repr(kwargs[param]) in str(info.value)


def test_unknown_switch_is_named() -> None:
    with pytest.raises(UnknownSwitch, match="SPLT_ATTN"):
        EngineConfig(switches={"SPLT_ATTN": True})


def test_from_mapping_coerces_and_rejects_unknown_keys() -> None:
    cfg = EngineConfig.from_mapping({"batch": "6", "batch-mtp": True, "kv": "int8", "vram_reserve_mib": 1280})
    assert (cfg.batch, cfg.batch_mtp, cfg.kv, cfg.vram_reserve_mib) == (6, True, "int8", 1280)
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_mapping({"batchsize": 6})
    assert info.value.param == "batchsize"
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_mapping({"batch_mtp": "yes"})
    assert info.value.param == "batch_mtp"


@pytest.mark.parametrize(("values", "param"), [
    ({"queue_max": 10 ** 23}, "queue_max"), ({"step_token_budget": 10 ** 23}, "step_token_budget"),
    ({"tier_wait_polls": 10 ** 23}, "tier_wait_polls"), ({"tier_wait_interval_s": float("nan")}, "tier_wait_interval_s"),
    ({"tier_wait_interval_s": 1e30}, "tier_wait_interval_s"), ({"context": "٤"}, "context"),
    ({"batch": "²"}, "batch"),
])
def test_a_profile_number_past_its_bounds_or_in_other_digits_is_refused(values: dict, param: str) -> None:
    """A profile's [engine] table goes through the same checks as argv (from_mapping)."""
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_mapping(values)
    assert info.value.param == param


def test_argv_round_trips_through_the_cli_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from engine.config import add_engine_options, config_from_args

    cfg = EngineConfig(batch=6, batch_mtp=True, mtp_depth=2, kv="int8", context=16384, vram_reserve_mib=1280,
                       graphs=False, port=8080, host="0.0.0.0", api_key="k", max_body_mib=3)
    assert "k" not in cfg.to_argv()  # the key travels in the environment, never in a process list
    for name, value in cfg.secret_env().items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_engine_options(parser, serving=True)
    back = config_from_args(parser.parse_args(cfg.to_argv()))
    assert back.to_dict(reveal_secrets=True) | {"switches": {}} == cfg.to_dict(reveal_secrets=True) | {"switches": {}}


def test_switch_env_uses_strata_prefix() -> None:
    cfg = EngineConfig(switches={"SPLIT_ATTN": True, "COMPILE": False})
    assert cfg.switch_env() == {"STRATA_SPLIT_ATTN": "1", "STRATA_COMPILE": "0"}
