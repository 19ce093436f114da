"""STRATA_KV_PREFETCH: 0 or 1, default 1; anything else is a one-line EnvError."""

from __future__ import annotations

import pytest

from strata_mgpu import env


@pytest.mark.parametrize("raw,want", [(None, True), ("", True), ("0", False), ("1", True), (" 1 ", True)])
def test_kv_prefetch_values(set_env, raw, want):
    set_env("STRATA_KV_PREFETCH", raw)
    assert env.kv_prefetch() is want


@pytest.mark.parametrize("raw", ["2", "yes", "on", "true", "-1"])
def test_kv_prefetch_rejects_anything_else(monkeypatch, raw):
    monkeypatch.setenv("STRATA_KV_PREFETCH", raw)
    with pytest.raises(env.EnvError, match="STRATA_KV_PREFETCH=.*expected 0 or 1") as e:
        env.kv_prefetch()
    assert "\n" not in str(e.value)


def test_kv_prefetch_is_listed():
    assert env.KV_PREFETCH in env.ALL
