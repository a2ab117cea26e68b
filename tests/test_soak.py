"""The shortened soak (bench/soak.py): mixed hostile traffic, then nothing broken or leaked."""

from __future__ import annotations

import pytest

from bench.soak import run_soak

pytestmark = pytest.mark.slow  # a soak run


def test_short_soak(llama_dir) -> None:
    # 10 s here: ~3,000 requests (every kind, 429s from the bursts), far past the bars below
    result = run_soak(
        str(llama_dir), seconds=10, clients=16, max_tokens=16, extra=["--max-model-len", "512"]
    )
    assert result["requests"] > 100, result
    assert result["server_errors"] == 0, result
    assert result["canary_mismatches"] == 0, result
    assert result["idle_running"] == 0 and result["idle_waiting"] == 0, result
    assert result["idle_kv_usage"] == 0.0, result
    assert result["status"].get("429", 0) > 0, result  # bursts went past the queue bound
    assert result["by_kind"].get("malformed", 0) > 0
