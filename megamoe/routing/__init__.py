"""Routers, chosen by `MoEConfig.router_type` through the `ROUTERS` registry
(`megamoe.registry`): each router module registers its class, and importing it here is what adds
it."""
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, Routing
from megamoe.routing.capacity import apply_capacity, expert_capacity
# Imported (so registered) in the order the config lists the router types.
from megamoe.routing.topk import TopKRouter
from megamoe.routing.top_p import TopPRouter
from megamoe.routing.threshold import ThresholdRouter
from megamoe.routing.sinkhorn import SinkhornRouter
from megamoe.routing.base_layers import BaseLayersRouter

__all__ = ["ROUTERS", "BaseLayersRouter", "Router", "Routing", "SinkhornRouter",
           "ThresholdRouter", "TopKRouter", "TopPRouter", "apply_capacity", "expert_capacity"]
