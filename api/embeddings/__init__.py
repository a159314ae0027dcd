"""Embeddings, rerank and score: the routes of embedding and cross-encoder models."""
