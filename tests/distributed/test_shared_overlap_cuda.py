"""On CUDA the shared expert runs on a side stream while the routed tokens are dispatched; the
layer must give what the same layer gives on CPU, where everything runs inline."""
import copy

import pytest
import torch

from megamoe import MoEConfig, SharedExpertConfig
from megamoe.layer import MoELayer
from megamoe.parallel import overlap

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_shared_expert_on_side_stream_matches_cpu():
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=64, num_experts=8, ffn_hidden_size=96, topk=2,
                    shared_expert=SharedExpertConfig(ffn_hidden_size=128, gate=True),
                    init_method_std=0.1)
    layer_cpu = MoELayer(cfg)
    layer_gpu = copy.deepcopy(layer_cpu).cuda()
    x = torch.randn(32, 4, 64)
    outputs, grads = [], []
    for layer, device in ((layer_cpu, "cpu"), (layer_gpu, "cuda")):
        x_dev = x.to(device, copy=True).requires_grad_()  # a leaf of its own on each device
        y = layer(x_dev)[0]
        y.square().sum().backward()
        outputs.append(y.detach().cpu())
        grads.append([x_dev.grad.cpu()] + [p.grad.cpu() for p in layer.parameters()])
    assert torch.device("cuda", torch.cuda.current_device()) in overlap._SIDE_STREAMS
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
