"""Property-based conformance of the live server with its own /openapi.json (schemathesis): no
5xx, and every response matches the published schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_utils import server_fixture

pytestmark = pytest.mark.slow  # schema-driven traffic against a server

# a short context keeps generated requests (n up to 16, default max_tokens) quick
server = server_fixture(num_kv_blocks=64, max_model_len=96, max_queue_len=64)


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base + "/openapi.json")


def test_api_conforms_to_its_schema(api_schema) -> None:
    # Driven through hypothesis directly: schemathesis' pytest plugin predates pytest 9.
    checks = [
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        negative_data_rejection,
    ]
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 6
    seen: dict[tuple[str, str], int] = {}
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    pairs = [(op, m) for op in operations for m in modes if m in modes[:1] or len(op.body)]
    for operation, mode in pairs:

        @settings(
            max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            response = case.call(timeout=60)
            assert response.status_code < 500, (
                case.path,
                response.status_code,
                response.text[:500],
            )
            case.validate_response(response, checks=checks)
            key = (case.path, str(case.meta.generation.mode) if case.meta else "?")
            seen[key] = seen.get(key, 0) + 1

        run()
    assert len(seen) >= 10, seen  # both modes on every operation that takes a body
