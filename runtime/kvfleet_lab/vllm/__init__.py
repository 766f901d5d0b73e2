"""Measurements of the kvfleet vLLM connector: `bench` (`kvfleet bench vllm-connector`), which
runs in vLLM's own environment (scripts/vllm-env.sh), never in the main one; and `t2` (the
connector's T2 fetch against the bare transfer, `python -m kvfleet_lab.vllm.t2`), which imports
no vllm and runs in either."""

__all__: list[str] = []
