"""The memory and layout planner (`tools/plan_memory.py`, docs/memory_planner.md): per rank
and category, the bytes training a config holds at its peak, for the config's layout or every
layout of a world size; checked against a real CPU run with `--measure`.

Modules, one job each: `layouts` (which layouts, which rank where), `shards` (each pipeline
stage's shard of the real model built on the meta device as one rank of a fake process group),
`state` (bytes of parameters, gradient buffers, optimizer state), `activations` (the saved
tensors of one micro-batch, term by term), `schedule` (the pipeline schedule's peak), `plan`
(all of it per stage), `report` (table, JSON, PNG), `measure` and `tracker` (the real run),
`counts` (the whole model's parameters by part) and `published` (released models' published
parameter counts beside the planner's).
"""
