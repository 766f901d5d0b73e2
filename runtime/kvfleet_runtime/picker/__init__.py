"""The picker: which replica serves a request, for both fronts (`kvfleet router`, `kvfleet epp`).

    _picker         Picker, PickRequest, Pick: one tokenization per request, matched tokens
                    (hint index, vLLM's KV events), the decision, the failover order, metrics
    _tenancy        Tenancy: API key -> tenant, the signed assertion to replicas, vLLM's
                    cache_salt body
    _tokens         the ids a replica sees for a prompt or chat messages
    _view           FleetView: the published config (watched), replicas, load reports, in flight
    _kv_events      what each vLLM replica holds, from its KV events (pure)
    _kv_metrics     the KV views' Prometheus series
    _kv_subscriber  the ZMQ shell feeding the views (zmq imported only when subscribing)

Pure decisions live in `kvfleet_runtime.affinity`; the fronts own the sockets. No torch.
"""

from __future__ import annotations

from kvfleet_runtime.picker._kv_events import KvEventViews
from kvfleet_runtime.picker._picker import Pick, Picker, PickRequest, Target
from kvfleet_runtime.picker._tenancy import Tenancy
from kvfleet_runtime.picker._tokens import chat_token_ids, prompt_token_ids
from kvfleet_runtime.picker._view import FleetView, vllm_load_report

__all__ = ["FleetView", "KvEventViews", "Pick", "PickRequest", "Picker", "Target", "Tenancy",
           "chat_token_ids", "prompt_token_ids", "vllm_load_report"]
