"""The strategy classes, which compose the degrees' folders into what the loop runs: `single`,
`dp`, `dp_criterion` (replicas in one process), `model_parallel` (the stage cut in one process),
`replicated.Replicated` (DDP alone: ddp, hybrid) and `mesh.Mesh` (every other layout of one
process per rank), both on `distributed.Distributed`'s process group."""
