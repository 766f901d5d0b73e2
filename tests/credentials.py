"""The credentials test fleets run with, and how a test plays the router or the operator.

Real replicas in tests hold a router secret and an operator token like the chart's pods do
(`kvfleet_runtime.auth`); a test that talks to a replica directly signs its tenant requests the
way the router does and presents the operator token on /cache/*, or it is refused.
"""

from __future__ import annotations

import time
import urllib.parse

from kvfleet_runtime.auth import sign_assertion
from kvfleet_runtime.wire import ASSERTION_HEADER, TENANT_HEADER

ROUTER_SECRET = "router-secret-under-test"
OPERATOR_TOKEN = "operator-token-under-test"
METRICS_TOKEN = "metrics-token-under-test"
"""What Prometheus presents to scrape per-tenant series (as the chart's ServiceMonitor does)."""

ENV = {"KVFLEET_ROUTER_SECRET": ROUTER_SECRET, "KVFLEET_OPERATOR_TOKEN": OPERATOR_TOKEN,
       "KVFLEET_METRICS_TOKEN": METRICS_TOKEN}
"""For a replica process (router processes need only KVFLEET_ROUTER_SECRET; extra is harmless)."""

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
SCRAPE_AUTHORIZATION = {"type": "Bearer", "credentials": METRICS_TOKEN}
"""A Prometheus scrape config's `authorization` for the replicas."""


def as_router(tenant: str, url: str, *, audience: str = "", method: str = "POST"
              ) -> dict[str, str]:
    """The headers the router sends with a request for `tenant` to `url` on the replica named
    `audience` ("" for a replica that does not know its fleet name)."""
    path = urllib.parse.urlsplit(url).path
    return {TENANT_HEADER: tenant, ASSERTION_HEADER: sign_assertion(
        ROUTER_SECRET.encode(), tenant, audience=audience, method=method, path=path,
        now_s=time.time())}


NAME_BY_URL: dict[str, str] = {}
"""Replica base URL -> fleet name, for fixtures that start named replicas (`as_router`'s
audience); fixtures register their replicas here."""


def as_router_to(tenant: str, base_url: str, path: str = "/v1/completions") -> dict[str, str]:
    """`as_router` for a registered replica (its audience from `NAME_BY_URL`)."""
    return as_router(tenant, base_url + path, audience=NAME_BY_URL.get(base_url, ""))
