"""The wire protocol as another language's producer, subscriber and operator would speak it:
raw redis-py commands and msgpack bytes, written from protocol/README.md alone."""
