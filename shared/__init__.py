"""What api and worker both import: settings, wire contracts, Redis key names, the queue,
request errors, grammars, the tokenizer, logging, metrics, tracing and retries.

Imports nothing else of Ladle's: both sides depend on it, it depends on neither. A module
only one side uses belongs to that side (`tests/unit/test_architecture.py` checks).
"""
