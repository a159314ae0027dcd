"""The OpenAI surface: request bodies, prompts to token ids, structured outputs and tools,
one request end to end, and worker events shaped as OpenAI responses and stream chunks."""
