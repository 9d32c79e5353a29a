"""Batches: BatchedDataDict and the batch contract."""

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import BatchValidationError, validate_batch

__all__ = ["BatchValidationError", "BatchedDataDict", "validate_batch"]
