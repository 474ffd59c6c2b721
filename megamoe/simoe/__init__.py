"""SIMoE: Sparse Interpolated Mixture-of-Experts (Chen, Wei, Schwarz, ACL 2025, arXiv 2506.12597).

- `config.SIMoEConfig`: the knobs (experts, target sparsity, ...).
- `hard_concrete`: the L0 gates that make each expert's structured mask.
- `interpolated`: W = W0 + (sum_m a_m z_m) * Delta inside Megatron-Core's parallel linears / norms.
- `merge`: the prompt router and the per-sequence merging coefficients.
- `penalties`: expected-L0 sparsity Lagrangian and mask-overlap penalty.
- `model.SIMoEGPTModel`: a Megatron-Core GPTModel built with all of it.
"""
