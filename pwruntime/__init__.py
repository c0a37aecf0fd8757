"""pwruntime: the real PagedWeight runtime (model, AP weights, kernels glue, pages, engine, server)."""
