"""The engine's scheduling core, plain Python and never torch: requests, sampling params, the
block manager (paged KV and prefix cache bookkeeping), the scheduler, its outputs and the
n-gram drafter. The model runner turns what it schedules into tensors."""
