"""API keys and what each may do: the key ring (`LLM_API_KEYS` and the keys file) and the
per-key requests and tokens per minute."""
