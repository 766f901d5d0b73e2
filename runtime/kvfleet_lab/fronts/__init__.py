"""`kvfleet bench fronts`: fronts (front proxies and, later, gateway pickers) side by side over the
same two serving vLLM replicas and the same `vllm bench serve` clients.

    table     the fronts: one `Front` entry each (a command line and what to read from it)
    figures   pure: runs and histograms read back, the comparison against the targets
    decision  the picker's decision latency on a long prompt, in-process (main venv)
    run       the runner (serving vLLM's environment)
"""
