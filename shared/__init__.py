"""Settings, wire contracts, Redis key names, logging and metrics shared by api and worker.

Imports nothing else of Ladle's: both sides depend on it, it depends on neither.
"""
