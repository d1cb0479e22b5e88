"""Ground truth: the token-by-token recurrence."""
from kda.reference.recurrent import recurrent_kda

__all__ = ["recurrent_kda"]
