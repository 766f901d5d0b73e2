"""Schemathesis fuzzes the replica from its own /openapi.json: whatever it sends, no 5xx.

Beyond "no 5xx", responses must use documented status codes, content types and schemas, and
data the schema forbids (unknown fields, wrong types, out-of-range values) must be rejected.
Not checked: "every schema-valid request is accepted", because some valid-looking requests are
refused by design with a documented 400 (a text prompt whose UTF-8 bytes exceed the token limit,
a prompt plus max_tokens beyond the context). Bounded: a few dozen cases per operation and mode.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

from .conftest import RunningReplica, as_router

CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_fuzz_from_openapi_finds_no_server_error(
    running: RunningReplica, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(running.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/cache/invalidate"}
    extra = [checks.negative_data_rejection] if mode is GenerationMode.NEGATIVE else []
    for operation in operations:
        if operation.path == "/cache/invalidate" and mode is GenerationMode.POSITIVE:
            continue  # valid digests would empty the shared cache; covered in test_api
        raw = operation.definition.raw
        if mode is GenerationMode.NEGATIVE and not (raw.get("parameters") or
                                                    raw.get("requestBody")):
            continue  # nothing to send that could be invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=20, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case: schemathesis.Case) -> None:
            # The fuzzer plays the router and the operator: every request it sends is signed.
            case.headers = as_router(dict(case.headers or {}), case.method,
                                     running.base_url + case.formatted_path)
            case.call_and_validate(base_url=running.base_url, timeout=30,
                                   checks=CHECKS + extra)

        fuzz()
