"""The operator tests' cluster fixtures, for the operator benchmark on the test cluster."""

from tests.operator.conftest import installed, operator_identity, operator_logs

__all__ = ["installed", "operator_identity", "operator_logs"]
