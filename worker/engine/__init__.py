"""Ladle's inference engine: scheduler and block manager (pure bookkeeping), model runner,
sampler, detokenizer and the step loop. Usable without Redis through `generate()`."""
