"""Schemathesis fuzzes the replica from its own /openapi.json with every check it has: no 5xx,
documented status codes, content types, headers and schemas, schema-invalid data refused and
schema-valid data accepted. Bounded: a few dozen cases per operation and mode.

Schema-valid data is accepted except where JSON Schema cannot state a limit: a text prompt is
limited in tokens (the schema can bound only its characters) and a prompt plus max_tokens must
fit the model's context, and vLLM's `min_tokens` may not exceed `max_tokens`. Those refusals are
400s with their own codes, `prompt_too_long`, `context_length_exceeded` and
`min_tokens_exceeds_max_tokens`, naming the numbers; `documented_limits` accepts exactly those and
leaves every other case to schemathesis's own check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

from kvfleet_runtime.server import MIN_TOKENS_CODE

from .conftest import RunningReplica, as_router

LIMIT_CODES = {"prompt_too_long", "context_length_exceeded", MIN_TOKENS_CODE}


def is_documented_limit(response: Any) -> bool:
    if response.status_code != 400:
        return False
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return error.get("code") in LIMIT_CODES and any(c.isdigit() for c in error["message"])


@schemathesis.check
def documented_limits(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """positive_data_acceptance, except the two limits JSON Schema cannot express."""
    if is_documented_limit(response):
        return None
    return checks.positive_data_acceptance(ctx, response, case)


def fuzz_operations(base_url: str, mode: GenerationMode, headers: dict[str, str] | None = None,
                    skip: set[tuple[str, GenerationMode]] | None = None,
                    max_examples: int = 15,
                    prepare: Callable[[schemathesis.Case], None] | None = None
                    ) -> tuple[set[str], set[str]]:
    """Fuzz every operation; returns (all paths, paths with no invalid data to generate).
    `prepare(case)` may add what a real caller adds (credentials) before each call."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    nothing_invalid: set[str] = set()
    for operation in operations:
        if (operation.path, mode) in (skip or set()):
            continue
        raw = operation.definition.raw
        if mode is GenerationMode.NEGATIVE and not (raw.get("parameters") or
                                                    raw.get("requestBody")):
            continue  # nothing to send that could be invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=max_examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case: schemathesis.Case) -> None:
            if prepare is not None:
                prepare(case)
            case.call_and_validate(base_url=base_url, headers=headers, timeout=30,
                                   excluded_checks=[checks.positive_data_acceptance,
                                                    checks.max_response_time],
                                   additional_checks=[documented_limits])

        try:
            fuzz()
        except Unsatisfiable:
            if mode is not GenerationMode.NEGATIVE:
                raise
            nothing_invalid.add(operation.path)  # e.g. a path parameter that any string fits
    return {op.path for op in operations}, nothing_invalid


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_fuzz_from_openapi_finds_no_failure_of_any_check(
    running: RunningReplica, mode: GenerationMode
) -> None:
    # Valid digests would empty the shared cache; invalidation is covered in test_api.
    def sign(case: schemathesis.Case) -> None:
        # The fuzzer plays the router and the operator: every request it sends is signed.
        case.headers = as_router(dict(case.headers or {}), case.method,
                                 running.base_url + case.formatted_path)

    paths, nothing_invalid = fuzz_operations(
        running.base_url, mode, skip={("/cache/invalidate", GenerationMode.POSITIVE)},
        prepare=sign)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models/{model}",
            "/cache/invalidate"} <= paths
    assert nothing_invalid <= {"/v1/models/{model}"}
