"""A megamoe layer in a plain PyTorch model: no Megatron, no host framework.

The script runs in a fresh interpreter, so `sys.modules` shows what importing and training the
core really pulls in. It trains a small `torch.nn` language model whose MLP is a `MoELayer`
(top-2, aux loss plus loss-free bias balancing) with torch's Adam and `step_balancing` once per
step, and checks against independent references: the layer's output against the naive per-token
loop of `reference.py`, and an attached balance loss against adding it to the objective.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe import ConfigError, MoEConfig
from megamoe.balancing.losses import attach_loss

SCRIPT = r"""
import json, sys
import torch
from torch import nn

sys.path.insert(0, sys.argv[1])
from reference import naive_moe
from megamoe import BalancingConfig, MoEConfig
from megamoe.balancing import step_balancing
from megamoe.layer import MoELayer

torch.manual_seed(0)
V, D = 32, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.moe = MoELayer(MoEConfig(
            hidden_size=D, num_experts=4, ffn_hidden_size=32, topk=2,
            balancing=BalancingConfig(methods=["bias", "aux_loss"], aux_loss_coeff=1e-2,
                                      bias_update_rate=1e-2)))
        self.head = nn.Linear(D, V)

    def forward(self, tokens_BS):
        h_SBD = self.embed(tokens_BS).transpose(0, 1)
        y_SBD, _ = self.moe(h_SBD)
        return self.head((h_SBD + y_SBD).transpose(0, 1))


model = TinyLM()
x_TD = torch.randn(12, D)
routing = model.moe.router(x_TD)
chosen = [torch.nonzero(r).flatten().tolist() for r in routing.routing_map_TE]
model.moe.eval()
with torch.no_grad():
    out = model.moe(x_TD.view(12, 1, D))[0].view(12, D)
    naive = naive_moe(x_TD, chosen, routing.gates_TE.tolist(), model.moe.experts.fc1_weight,
                      model.moe.experts.fc2_weight, "swiglu")
model.moe.train()

optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)
losses = []
for step in range(40):
    start = torch.randint(0, V, (8, 1), generator=data)
    tokens = (start + torch.arange(17)) % V  # next token = token + 1
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    metrics = step_balancing(model)
    losses.append(float(loss))
hosts = sorted({m.split(".")[0] for m in sys.modules} &
               {"megatron", "transformer_engine", "apex", "deepspeed", "transformers"})
print(json.dumps({"losses": losses, "naive_diff": float((out - naive).abs().max()),
                  "bias": model.moe.router.expert_bias.tolist(), "hosts": hosts,
                  "has_maxvio": "moe/layer0/maxvio_global" in metrics}))
"""


@pytest.mark.slow
def test_layer_trains_in_a_plain_torch_model():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["hosts"] == []
    assert result["naive_diff"] < 1e-5
    assert result["losses"][-1] < 0.5 * result["losses"][0]
    assert any(abs(b) > 0 for b in result["bias"]) and result["has_maxvio"]


def test_an_attached_loss_trains_as_if_added_to_the_objective():
    torch.manual_seed(0)
    weight = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 3)

    def parts():
        y = x @ weight.t()
        return y, (weight ** 2).sum() * 0.1

    y, aux = parts()
    (attach_loss(y, aux) * 2.0).sum().backward()
    attached, weight.grad = weight.grad.clone(), None
    y, aux = parts()
    ((y * 2.0).sum() + aux).backward()
    torch.testing.assert_close(attached, weight.grad)
    y, aux = parts()
    assert torch.equal(attach_loss(y, aux), y)


def test_layer_config_names_come_from_the_registries():
    from megamoe.registry import ACTIVATIONS, DISPATCHERS, ROUTERS

    assert set(ROUTERS.names()) == {"topk", "top_p", "threshold", "sinkhorn", "base", "hash"}
    assert set(DISPATCHERS.names()) == {"alltoall", "allgather"}
    assert set(ACTIVATIONS.names()) == {"swiglu", "clamped_swiglu", "gelu", "squared_relu"}
    base = dict(hidden_size=8, num_experts=4, ffn_hidden_size=8)
    for section, field, registry in (("router", "kind", ROUTERS),
                                     ("dispatcher", "kind", DISPATCHERS),
                                     ("experts", "activation", ACTIVATIONS)):
        with pytest.raises(ConfigError, match=re.escape(
                f"{section}.{field}='nope' is not one of {list(registry.names())}")):
            MoEConfig.from_dict({**base, section: {field: "nope"}})
