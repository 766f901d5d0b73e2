"""Measurements of the kvfleet vLLM connector (`kvfleet bench vllm-connector`); they run in
vLLM's own environment (scripts/vllm-env.sh), never in the main one."""

__all__: list[str] = []
