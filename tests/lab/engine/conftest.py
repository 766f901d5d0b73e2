"""The engine tests' tiny checkpoint, for the replica benchmark."""

from tests.runtime.engine.conftest import _one_cpu_thread, tiny_dir

__all__ = ["_one_cpu_thread", "tiny_dir"]
