"""The operator's commands: `ladle up` (broker, API, workers under a supervisor) and
`ladle batch`. Neither the API nor the worker imports this package; it starts them."""
