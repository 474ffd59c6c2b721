"""A Megatron-Core GPTModel with megamoe layers: EP=2 x DP=2 on 2 processes against EP=1."""


def test_gpt_30_steps_at_ep2_dp2_match_ep1(world1, world2):
    single, parallel = world1[0]["gpt"], world2[0]["gpt"]
    assert len(single) == len(parallel) == 30
    assert max(abs(a - b) for a, b in zip(single, parallel)) < 1e-4
    assert parallel[-1] < 0.7 * parallel[0]
