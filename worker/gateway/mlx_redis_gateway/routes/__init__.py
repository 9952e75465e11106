"""The gateway's routes, a module per group: completions (chat and text), the Responses API,
models and health, a request's answer again, and the status page."""
