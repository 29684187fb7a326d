"""Skip connections for Sequentials, pipelines and experts.

A ``@skippable`` layer stashes a tensor that a later layer pops, skipping the
layers between (see :mod:`moe_autograd.skip.skippable`). Where the tensor
waits is the business of the thread's skip tracker
(:mod:`moe_autograd.skip.tracker`); across partitions it travels through a
portal (:mod:`moe_autograd.skip.portal`) along the routes of a skip layout
(:mod:`moe_autograd.skip.layout`).
"""
from .namespace import Namespace
from .skippable import Skippable, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace", "Skippable"]
