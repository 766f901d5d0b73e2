"""The tiny checkpoint and the engine tests' one CPU thread, for the replica benchmark."""

from tests.runtime.engine.conftest import _one_cpu_thread
from tests.support import tiny_dir

__all__ = ["_one_cpu_thread", "tiny_dir"]
