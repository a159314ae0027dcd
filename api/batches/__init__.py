"""The Batch API: uploaded files, batch records, expansion into line jobs of the batch lane,
collection of their results exactly once, and `/v1/files` and `/v1/batches`."""
