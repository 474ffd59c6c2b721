"""Load balancing: loss-free expert bias, aux / sequence-aux / z / entropy losses, load metrics."""
from megamoe.balancing.balancer import bias_update, routers_of, step_balancing
from megamoe.balancing.losses import entropy_loss, sequence_aux_loss, switch_aux_loss, z_loss
from megamoe.balancing.tracker import LoadTracker, maxvio

__all__ = ["LoadTracker", "bias_update", "entropy_loss", "maxvio", "routers_of",
           "sequence_aux_loss", "step_balancing", "switch_aux_loss", "z_loss"]
