"""The host<->guest channel: framed, multiplexed streams over one byte pipe (stdlib only).

Both the node (host side) and the guest agent import this module, so it must run on a bare
CPython standard library.

Wire format: every frame is a 9-byte header ``kind:u8 stream:u32 length:u32`` (big endian)
followed by ``length`` payload bytes. Stream 0 is the control stream.

    OPEN    both          JSON {"m": method, "p": params}; starts stream N (the host numbers its
                          streams odd, the guest even: the guest opens egress connections)
    MSG     both          one JSON message on stream N
    DATA    both          raw bytes on stream N
    EOF     both          the sender will send no more MSG/DATA on stream N
    END     both          stream N is over; JSON {"result": ...} or {"error": {"code", "message"}}
                          (host->guest END means "cancel": the host lost interest)
    CREDIT  both          u32: the receiver grants that many more payload bytes on stream N
    CTRL    both          JSON on stream 0: hello / freeze / frozen / thaw

Flow control is per stream and per direction: a sender may have at most ``window`` payload bytes
(MSG + DATA) unacknowledged; the receiver grants credit as its consumer takes items. A stalled
consumer therefore stalls only its own stream, never the pipe.

Every frame is untrusted input (root in a sandbox can write to the agent's pipe): a frame of an
unknown kind or larger than its kind allows, JSON that is not strict UTF-8 JSON, data beyond the
credit granted, more credit than was ever spent, an OPEN of a stream id in use (or past
``max_peer_streams``), more queued items than a window's worth: each is a
:class:`ProtocolViolation`, which closes the channel (the node then removes the sandbox). Nothing
the peer sends makes this side hold more than a window (plus one frame) per stream.

Checkpoint safety: before the runtime checkpoints a sandbox the host sends CTRL freeze; the
guest answers CTRL frozen and then writes nothing until CTRL thaw. The host writes nothing
between freeze and thaw. Both directions of the pipe are therefore on a frame boundary inside
the checkpoint image, and a restored guest can be attached to a brand new pipe.

The parts: :mod:`~aenv.channel.frames` (kinds, limits, the strict codec, the errors),
:mod:`~aenv.channel.stream` (one stream: its queue and credit), :mod:`~aenv.channel.connection`
(the pipe's reader and writer, opening and serving streams), :mod:`~aenv.channel.splice` (a stream
to a TCP connection). Everything is imported from here.
"""

from __future__ import annotations

from aenv.channel.connection import (
    DEFAULT_WINDOW,
    FRAME_COST,
    SHARE_BURST,
    Channel,
    CtrlHandler,
    OpenHandler,
)
from aenv.channel.frames import (
    CREDIT,
    CTRL,
    DATA,
    END,
    EOF,
    GRANT,
    HEADER,
    MAX_CTRL,
    MAX_GUEST_STREAMS,
    MAX_JSON,
    MAX_LENGTH,
    MAX_PAYLOAD,
    MSG,
    OPEN,
    PROTOCOL_VIOLATION,
    ChannelClosed,
    ProtocolViolation,
    StreamError,
    Unsendable,
    dumps,
    encode,
    end_error,
    loads,
)
from aenv.channel.splice import (
    END_LINGER,
    SPLICE_CHUNK,
    SPLICE_LINGER,
    splice,
)
from aenv.channel.stream import (
    COALESCE_BELOW,
    ITEM_FLOOR,
    Item,
    Stream,
)

__all__ = [
    "COALESCE_BELOW",
    "CREDIT",
    "CTRL",
    "DATA",
    "DEFAULT_WINDOW",
    "END",
    "END_LINGER",
    "EOF",
    "FRAME_COST",
    "GRANT",
    "HEADER",
    "ITEM_FLOOR",
    "MAX_CTRL",
    "MAX_GUEST_STREAMS",
    "MAX_JSON",
    "MAX_LENGTH",
    "MAX_PAYLOAD",
    "MSG",
    "OPEN",
    "PROTOCOL_VIOLATION",
    "SHARE_BURST",
    "SPLICE_CHUNK",
    "SPLICE_LINGER",
    "Channel",
    "ChannelClosed",
    "CtrlHandler",
    "Item",
    "OpenHandler",
    "ProtocolViolation",
    "Stream",
    "StreamError",
    "Unsendable",
    "dumps",
    "encode",
    "end_error",
    "loads",
    "splice",
]
