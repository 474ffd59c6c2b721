"""megamoe's optimizers: Muon (`muon.Muon`, Newton-Schulz orthogonalised momentum,
`newton_schulz`), the split of a model's parameters between Muon and AdamW (`params`) and the
owner of each parameter when the state is sharded over data-parallel ranks (`sharding`).
The trainer's wiring into Megatron-Core is `megamoe.train.muon_optimizer`; MuonClip's QK-clip,
which needs Megatron's attention modules, is `megamoe.train.qk_clip`."""
