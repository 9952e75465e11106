"""The Redis wire protocol of mlx-worker: keys, messages, codec, client and CLI.

The specification is protocol/README.md. Nothing here imports from the worker or the gateway, or
needs MLX.
"""

from mlx_redis_protocol.catalogue import Fleet, fleet_models, served_models
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_control import (
    decode_command,
    decode_reply,
    encode_command,
    encode_reply,
)
from mlx_redis_protocol.codec_events import decode_event, encode_event
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.constants import PROTOCOL_VERSION
from mlx_redis_protocol.control import ControlReplies
from mlx_redis_protocol.embeddings import EmbeddingFailed, Embeddings
from mlx_redis_protocol.errors import (
    ERROR_CODES,
    ClientError,
    ControlTimeout,
    ProtocolError,
    RedisUnavailable,
    RequestExpired,
    RequestLost,
    RequestNotFound,
    StreamRewritten,
    StreamTimeout,
)
from mlx_redis_protocol.heartbeat import Heartbeat, decode_heartbeat
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.messages import (
    ChatMessage,
    ControlCommand,
    ControlReply,
    DeltaEvent,
    DoneEvent,
    EmbeddingEvent,
    ErrorEvent,
    ErrorInfo,
    Event,
    Job,
    QueuedEvent,
    ResetEvent,
    TokenLogprob,
    UnknownEvent,
    Usage,
)
from mlx_redis_protocol.replay_log import last_seq, publish_events
from mlx_redis_protocol.sync_client import SyncClient

__all__ = [
    "DEFAULT_LIMITS",
    "ERROR_CODES",
    "PROTOCOL_VERSION",
    "ChatMessage",
    "Client",
    "ClientError",
    "ControlCommand",
    "ControlReplies",
    "ControlReply",
    "ControlTimeout",
    "DeltaEvent",
    "DoneEvent",
    "EmbeddingEvent",
    "EmbeddingFailed",
    "Embeddings",
    "ErrorEvent",
    "ErrorInfo",
    "Event",
    "Fleet",
    "Heartbeat",
    "Job",
    "JobStream",
    "Keys",
    "Limits",
    "ProtocolError",
    "QueuedEvent",
    "RedisUnavailable",
    "RequestExpired",
    "RequestLost",
    "RequestNotFound",
    "ResetEvent",
    "StreamRewritten",
    "StreamTimeout",
    "SyncClient",
    "TokenLogprob",
    "UnknownEvent",
    "Usage",
    "decode_command",
    "decode_event",
    "decode_heartbeat",
    "decode_job",
    "decode_reply",
    "encode_command",
    "encode_event",
    "encode_job",
    "encode_reply",
    "fleet_models",
    "last_seq",
    "publish_events",
    "served_models",
]
