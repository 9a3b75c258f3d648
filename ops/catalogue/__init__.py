"""The op catalogue: what each op is (slots, attrs, role, grad maker, shape rule)."""

from ops.catalogue.optimizers import OPTIMIZER_SLOTS, OptimizerSlots, UnknownOpError, optimizer_slots

__all__ = ["OPTIMIZER_SLOTS", "OptimizerSlots", "UnknownOpError", "optimizer_slots"]
