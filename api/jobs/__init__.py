"""Jobs on the API side: the job store (admission, enqueue, records, cancel), the relay of
stream events, `Idempotency-Key`, the live workers, the spans of a request, and `/v1/jobs`."""
