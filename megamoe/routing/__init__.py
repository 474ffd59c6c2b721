"""Routers, chosen by `MoEConfig.router.kind` through the `ROUTERS` registry
(`megamoe.registry`): each router module registers its class with its settings class (a
`RouterConfig` subclass), and importing it here is what adds it."""
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, Routing
from megamoe.routing.capacity import apply_capacity, expert_capacity
# Imported (so registered) in the order the config lists the router types.
from megamoe.routing.topk import TopKRouter, TopKRouterConfig
from megamoe.routing.top_p import TopPRouter, TopPRouterConfig
from megamoe.routing.threshold import ThresholdRouter, ThresholdRouterConfig
from megamoe.routing.sinkhorn import SinkhornRouter, SinkhornRouterConfig
from megamoe.routing.base_layers import BaseLayersRouter, BaseRouterConfig
from megamoe.routing.hash import HashRouter, HashRouterConfig

__all__ = ["ROUTERS", "BaseLayersRouter", "BaseRouterConfig", "HashRouter", "HashRouterConfig",
           "Router", "Routing",
           "SinkhornRouter", "SinkhornRouterConfig", "ThresholdRouter", "ThresholdRouterConfig",
           "TopKRouter", "TopKRouterConfig", "TopPRouter", "TopPRouterConfig", "apply_capacity",
           "expert_capacity"]
