"""Routed experts (stacked weights) and the shared expert."""
from megamoe.experts.activations import ACTIVATIONS
from megamoe.experts.grouped import GROUPED_MM, LOOP, GroupedExperts, expert_mlp
from megamoe.experts.shared import SharedExpert

__all__ = ["ACTIVATIONS", "GROUPED_MM", "GroupedExperts", "LOOP", "SharedExpert", "expert_mlp"]
