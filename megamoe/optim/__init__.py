"""megamoe's optimizers: Muon (`muon.Muon`, Newton-Schulz orthogonalised momentum,
`newton_schulz`) and the split of a model's parameters between Muon and AdamW (`params`).
The trainer's wiring into Megatron-Core is `megamoe.train.muon_optimizer`; MuonClip's QK-clip,
which needs Megatron's attention modules, is `megamoe.train.qk_clip`."""
