"""The Redis side of the worker: jobs in, events out, control, lifecycle."""
