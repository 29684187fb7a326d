"""The mixture-of-experts layer, built on the parallel runtime."""
from .layer import MixtureOfExperts, NotEnoughExperts
from .stats import ExpertStats

__all__ = ["MixtureOfExperts", "NotEnoughExperts", "ExpertStats"]
