"""Routers, chosen by `MoEConfig.router_type` through the `ROUTERS` registry."""
from megamoe.routing.base import Router, Routing
from megamoe.routing.capacity import apply_capacity, expert_capacity
from megamoe.routing.top_p import TopPRouter
from megamoe.routing.topk import TopKRouter

ROUTERS: dict[str, type[Router]] = {"topk": TopKRouter, "top_p": TopPRouter}

__all__ = ["ROUTERS", "Router", "Routing", "TopKRouter", "TopPRouter", "apply_capacity",
           "expert_capacity"]
