"""JSON requests to the test cluster's API server over one kept-alive TLS connection.

For loops that ask the API server several times a second (the e2e's kubelet shim, the demo's
rollout watch): a kubectl process per request costs about 0.05 s of CPU (the Go binary's start, a
TLS handshake, printing the objects again): the demo's polls that way took 0.24 of two shared
cores, more than its API server, router or operator (docs/benchmarks.md), load that fed the very
TLS handshake timeouts it then hit. One connection, kept alive, costs a request's work only.
Authenticates as the kubeconfig's user: a client certificate or a token (the shapes
tests/cluster/kubeconfig.py writes).
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.kubeconfig import current_cluster

STRATEGIC_MERGE = "application/strategic-merge-patch+json"


class ApiError(OSError):
    """The API server answered with an error status, or did not answer (`status` 0)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: {status or 'no answer'}: {message[:500]}")


def _current_user(path: Path) -> dict[str, Any]:
    config = yaml.safe_load(path.read_text()) or {}
    contexts = {c["name"]: c["context"] for c in config.get("contexts") or []}
    users = {u["name"]: u["user"] for u in config.get("users") or []}
    context = contexts.get(config.get("current-context"), {})
    return dict(users.get(context.get("user"), {}))


class ApiClient:
    """`get`/`patch`/`post` of JSON paths (`/api/v1/namespaces/...`); thread-safe (one request at
    a time on the connection); reconnects once when the server closed an idle connection."""

    def __init__(self, kubeconfig: Path, timeout_s: float = 20.0) -> None:
        cluster = current_cluster(kubeconfig)
        user = _current_user(kubeconfig)
        url = urllib.parse.urlsplit(str(cluster["server"]))
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.context = ssl.create_default_context(cafile=cluster.get("certificate-authority"))
        self.headers = {"Accept": "application/json"}
        if "client-certificate" in user:
            self.context.load_cert_chain(user["client-certificate"], user["client-key"])
        elif "token" in user:
            self.headers["Authorization"] = f"Bearer {user['token']}"
        else:
            raise ValueError(f"kubeconfig {kubeconfig}: ApiClient needs a client certificate or a "
                             "token (the test cluster's kubeconfigs have one)")
        self.timeout_s = timeout_s
        self._connection: http.client.HTTPSConnection | None = None
        self._lock = threading.Lock()

    def get(self, path: str, **query: str) -> Any:
        return self.request("GET", path, query=query)

    def patch(self, path: str, body: Any, content_type: str = STRATEGIC_MERGE) -> Any:
        return self.request("PATCH", path, body, content_type)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", query: dict[str, str] | None = None) -> Any:
        target = path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = content_type
        with self._lock:
            for attempt in (1, 2):
                try:
                    connection = self._connect()
                    connection.request(method, target, body=data, headers=headers)
                    response = connection.getresponse()
                    raw = response.read()
                    break
                except (OSError, http.client.HTTPException) as exc:
                    self.close()
                    # A kept-alive connection the server has closed fails at once: ask again on a
                    # new one. A second failure is the server's.
                    if attempt == 2 or isinstance(exc, TimeoutError):
                        raise ApiError(method, path, 0, repr(exc)) from None
        if response.status >= 400:
            raise ApiError(method, path, response.status, raw.decode(errors="replace"))
        return json.loads(raw) if raw else None

    def _connect(self) -> http.client.HTTPSConnection:
        if self._connection is None:
            self._connection = http.client.HTTPSConnection(
                self.host, self.port, context=self.context, timeout=self.timeout_s)
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
