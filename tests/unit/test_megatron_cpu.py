"""Megatron-Core's own GPT + MoE layer on CPU/gloo through megamoe.megatron.{cpu,runtime,models}."""
import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megamoe.errors import ConfigError
from megamoe.megatron.cpu import enable_megatron_on_cpu
from tiny_models import build_gpt, tiny_transformer_config
from megamoe.megatron.masks import causal_attention_mask
from megamoe.megatron.runtime import setup_megatron, teardown_megatron

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU path; with CUDA Megatron's own code paths apply"
)

VOCAB, SEQ, BATCH, EXPERTS, TOPK = 64, 16, 8, 4, 2


@pytest.fixture
def megatron():
    setup_megatron(seed=11)
    yield
    teardown_megatron()


def megatron_moe_gpt():
    config = tiny_transformer_config(
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall",
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_router_bias_update_rate=1e-2,
        moe_grouped_gemm=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    return build_gpt(config, spec, vocab_size=VOCAB, seq_len=SEQ)


def lm_batch(seed):
    """Sequences where the next token is always token + 1 (mod VOCAB): quickly learnable."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=torch.Generator().manual_seed(seed))
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def forward(model, tokens, labels=None):
    positions = torch.arange(SEQ).expand(tokens.shape[0], -1)
    return model(tokens, positions, causal_attention_mask(SEQ), labels=labels)


def routers(model):
    return [layer.mlp.router for layer in model.decoder.layers]


def test_causal_attention_mask_masks_exactly_the_future():
    mask = causal_attention_mask(5)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    for query in range(5):
        for key in range(5):
            assert bool(mask[0, 0, query, key]) == (key > query)


def test_megatron_moe_gpt_trains_on_cpu(megatron):
    model = megatron_moe_gpt()
    for layer in model.decoder.layers:
        assert isinstance(layer.mlp, MoELayer)
        assert isinstance(layer.mlp.experts, SequentialMLP)
        assert isinstance(layer.mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(10):
        loss = forward(model, *lm_batch(step)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        for router in routers(model):
            counts = router.local_tokens_per_expert.clone()
            # Every token went to exactly TOPK experts (dropless routing).
            assert counts.sum().item() == BATCH * SEQ * TOPK
            # Megatron's expert-bias update, all-reduced over gloo, against the loss-free
            # balancing rule it implements (arXiv:2408.15664): b += rate * sign(mean - count).
            expected = router.expert_bias + 1e-2 * torch.sign(counts.mean() - counts)
            updated = get_updated_expert_bias(
                tokens_per_expert=router.local_tokens_per_expert,
                expert_bias=router.expert_bias,
                expert_bias_update_rate=1e-2,
            )
            torch.testing.assert_close(updated, expected, rtol=0, atol=0)
            router.expert_bias.copy_(updated)
            router.local_tokens_per_expert.zero_()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.75 * losses[0]
    assert any(router.expert_bias.abs().sum() > 0 for router in routers(model))
    for name, param in model.named_parameters():
        assert param.grad is not None and param.device.type == "cpu", name


def test_dist_checkpoint_round_trip_preserves_outputs(megatron, tmp_path):
    trained = megatron_moe_gpt()
    tokens, _ = lm_batch(0)
    with torch.no_grad():
        for router in routers(trained):
            router.expert_bias.copy_(torch.linspace(-0.5, 0.5, EXPERTS))
        expected = forward(trained, tokens)
    dist_checkpointing.save(trained.sharded_state_dict(), str(tmp_path))

    torch.manual_seed(12345)
    restored = megatron_moe_gpt()
    with torch.no_grad():
        assert not torch.equal(forward(restored, tokens), expected)
    state = dist_checkpointing.load(restored.sharded_state_dict(), str(tmp_path))
    restored.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(forward(restored, tokens), expected)
    for router in routers(restored):
        assert torch.equal(router.expert_bias, torch.linspace(-0.5, 0.5, EXPERTS))


def test_setup_and_teardown_repeat_in_one_process():
    weights = []
    for _ in range(2):
        setup_megatron(seed=5)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert parallel_state.model_parallel_is_initialized()
        assert parallel_state.get_expert_model_parallel_world_size() == 1
        weights.append(megatron_moe_gpt().decoder.layers[0].mlp.router.weight.detach().clone())
        with pytest.raises(ConfigError, match="already initialised"):
            setup_megatron()
        teardown_megatron()
        assert not dist.is_initialized()
        assert not parallel_state.model_parallel_is_initialized()
    assert torch.equal(weights[0], weights[1])  # same seed, same initial weights


def test_setup_rejects_parallel_sizes_the_world_cannot_hold():
    with pytest.raises(ConfigError, match="tp\\*pp\\*cp = 2\\*1\\*1"):
        setup_megatron(tensor_model_parallel_size=2)
    with pytest.raises(ConfigError, match="etp\\*ep\\*pp = 1\\*4\\*1"):
        setup_megatron(expert_model_parallel_size=4)
    assert not dist.is_initialized()


def test_enable_megatron_on_cpu_is_idempotent():
    from megatron.core.transformer.moe.router import TopKRouter

    first = enable_megatron_on_cpu()
    init = TopKRouter.__init__
    assert enable_megatron_on_cpu() == first
    assert TopKRouter.__init__ is init


def test_teardown_leaves_a_callers_process_group_alone():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        setup_megatron()
        teardown_megatron()
        assert dist.is_initialized()
        assert not parallel_state.model_parallel_is_initialized()
    finally:
        dist.destroy_process_group()


def test_cuda_as_cpu_puts_megatrons_cuda_allocations_on_the_cpu():
    from megamoe.megatron.cpu import cuda_as_cpu

    with cuda_as_cpu():
        made = torch.zeros(3, dtype=torch.int, device="cuda")
        moved = torch.ones(2).cuda()
        target = torch.ones(2).to("cuda")
        names = (torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type())
        current = torch.cuda.current_device()
    assert made.device.type == moved.device.type == target.device.type == "cpu"
    assert names == ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor")
    assert current == torch.device("cpu")
    assert torch.ones(1).type() == "torch.FloatTensor"  # only inside the block
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_cuda_as_cpu_gives_host_streams_and_events():
    """megatron-core 0.19's gradient sync waits on `torch.cuda.current_stream()` every step;
    both versions build streams for overlapped communication. On the CPU they are no-ops."""
    from megamoe.megatron.cpu import cuda_as_cpu

    with cuda_as_cpu():
        stream = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=torch.cuda.current_device())
        event = torch.cuda.Event()
        stream.wait_event(event)
        side.wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(side):
            value = torch.ones(2, device="cuda") * 2
        side.record_event(event)
        torch.cuda.synchronize()
    assert torch.equal(value, torch.full((2,), 2.0))
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        torch.cuda.current_stream().synchronize()  # only inside the block


def test_megatrons_gradient_buffers_reduce_under_cuda_as_cpu(megatron):
    """Megatron-Core's DistributedDataParallel with the distributed optimizer's buffers
    finishes its gradient sync on the CPU (0.19 asks for the current CUDA stream there), and
    the reduced gradient is the plain one (world size 1)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megamoe.megatron.cpu import cuda_as_cpu

    config = tiny_transformer_config()
    module = torch.nn.Linear(4, 3, bias=False)
    reference = torch.nn.Linear(4, 3, bias=False)
    reference.load_state_dict(module.state_dict())
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with cuda_as_cpu():
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                  use_distributed_optimizer=True), module)
        ddp.zero_grad_buffer()
        ddp(x).square().sum().backward()
        ddp.finish_grad_sync()
    reference(x).square().sum().backward()
    torch.testing.assert_close(module.weight.main_grad, reference.weight.grad)


def test_torch_norm_under_sequence_parallelism_marks_its_weights(megatron):
    """Megatron's fused norms mark their weights so finalize_model_grads sums their gradients
    over the tensor-parallel group; the CPU torch norm does the same instead of refusing."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = tiny_transformer_config(sequence_parallel=True, tensor_model_parallel_size=2)
    norm = WrappedTorchNorm(config, 64)
    plain = WrappedTorchNorm(tiny_transformer_config(), 64)
    assert isinstance(norm, torch.nn.LayerNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert not any(getattr(p, "sequence_parallel", False) for p in plain.parameters())
    assert config.sequence_parallel  # the caller's config is left as it was
