"""Wire-level constants shared by producers, workers and subscribers."""

from __future__ import annotations

from typing import Final

# The major version carried in every message as ``v``. Additive changes (new optional fields,
# new event types) keep it; anything an old reader would misread bumps it.
PROTOCOL_VERSION: Final = 1

DEFAULT_PREFIX: Final = "mlxw"
DEFAULT_REDIS_URL: Final = "redis://localhost:6379/0"

# The replay log outlives its last event by this long, so a late subscriber can still read it.
DEFAULT_LOG_TTL_SECONDS: Final = 600
# An abort marker must outlive a job's wait in the queue, which can be longer than the log TTL.
DEFAULT_ABORT_TTL_SECONDS: Final = 3600
# How long a finished request id is remembered (``mlxw:done:{id}``), so a job queued again
# under it does not run again after its log expired; a day, as payment APIs keep theirs.
DEFAULT_IDEMPOTENCY_SECONDS: Final = 86400
# A control reply list only has to survive until the client's BLPOP picks it up.
DEFAULT_REPLY_TTL_SECONDS: Final = 60
DEFAULT_CONTROL_TIMEOUT_SECONDS: Final = 2.0

# Field names inside a job stream entry and a log stream entry.
JOB_FIELD: Final = "job"
# The field a forwarded job's entry carries: its id in the default stream (its arrival).
FORWARDED_FROM_FIELD: Final = "forwarded_from"
LOG_SEQ_FIELD: Final = "seq"
LOG_EVENT_FIELD: Final = "e"

# The tenant a job that names none is served as (fair share is kept between tenants).
DEFAULT_TENANT: Final = "default"
