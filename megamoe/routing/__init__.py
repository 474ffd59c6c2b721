"""Routers, chosen by `MoEConfig.router_type` through the `ROUTERS` registry."""
from megamoe.routing.base import Router, Routing
from megamoe.routing.base_layers import BaseLayersRouter
from megamoe.routing.capacity import apply_capacity, expert_capacity
from megamoe.routing.sinkhorn import SinkhornRouter
from megamoe.routing.threshold import ThresholdRouter
from megamoe.routing.top_p import TopPRouter
from megamoe.routing.topk import TopKRouter

ROUTERS: dict[str, type[Router]] = {
    "topk": TopKRouter,
    "top_p": TopPRouter,
    "threshold": ThresholdRouter,
    "sinkhorn": SinkhornRouter,
    "base": BaseLayersRouter,
}

__all__ = ["ROUTERS", "BaseLayersRouter", "Router", "Routing", "SinkhornRouter",
           "ThresholdRouter", "TopKRouter", "TopPRouter", "apply_capacity", "expert_capacity"]
