"""torch_dist checkpoints saved at EP=2 load at EP=1 and EP=4, and move between megamoe and
Megatron-Core's own MoE model (local spec, SequentialMLP) in both directions."""
import pytest
import torch

LOADED = ["world1", "world4"]


def test_checkpoint_layout_is_megatrons(world2):
    for result in world2:
        assert result["save"]["layout_mismatch"] == {"default": [], "singleton": []}


@pytest.mark.parametrize("world", LOADED)
@pytest.mark.parametrize("ckpt", ["megamoe", "megamoe_singleton"])
def test_resume_at_another_ep_size_gives_identical_outputs(world, ckpt, world2, request):
    expected = world2[0]["save"]["megamoe_logits"]
    for result in request.getfixturevalue(world):
        torch.testing.assert_close(result["load"][f"megamoe<-{ckpt}"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("world", LOADED)
def test_resume_loads_every_expert_by_its_global_id(world, world2, request):
    saved = {key: value for result in world2 for key, value in result["save"]["experts"].items()}
    loaded = {key: value for result in request.getfixturevalue(world)
              for key, value in result["load"]["experts"].items()}
    assert sorted(saved) == sorted(loaded) and len(saved) == 2 * 8
    # Experts e and e + 4 (same local index on ranks 0 and 1 at EP=2) differ, so a load by
    # local index would be caught.
    assert not torch.equal(saved["decoder.layers.0.expert0"], saved["decoder.layers.0.expert4"])
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), key


@pytest.mark.parametrize("world", LOADED)
def test_megatron_checkpoint_loads_into_megamoe(world, world2, request):
    expected = world2[0]["save"]["megatron_logits"]
    for result in request.getfixturevalue(world):
        torch.testing.assert_close(result["load"]["megamoe<-megatron"], expected,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", LOADED)
def test_megamoe_checkpoint_loads_into_megatron(world, world2, request):
    expected = world2[0]["save"]["megamoe_logits"]
    for result in request.getfixturevalue(world):
        torch.testing.assert_close(result["load"]["megatron<-megamoe"], expected,
                                   rtol=1e-5, atol=1e-5)
