"""Routed experts (stacked weights) and the shared expert."""
from megamoe.experts.activations import ACTIVATIONS
from megamoe.experts.grouped import GroupedExperts, loop_expert_mlp
from megamoe.experts.shared import SharedExpert

__all__ = ["ACTIVATIONS", "GroupedExperts", "SharedExpert", "loop_expert_mlp"]
