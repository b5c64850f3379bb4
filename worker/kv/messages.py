"""The side channel's messages between workers, typed: each is read from its JSON body here,
once, on arrival, and nowhere else by key (the wire format is unchanged: the same keys, sent as
they always were).

Requests (decode side -> prefill side) are taken as sent: their fields are checked where they
are used (the pin table refuses a wrong token, digest or index), as before, so a malformed one
is refused with the same error. Replies (prefill side -> decode side) are checked here, before
anything is read from them: a peer's numbers decide what a reader allocates and READs.
"""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import dataclass, field
from typing import Any

STATES = ("running", "done", "cancelled")  # of a streamed pin, in a progress reply


class MalformedReply(ValueError):
    """A peer's reply that does not say what it must (side_channel raises it as SideChannelError)."""


# -- the envelope: who a request is meant for ---------------------------------------------------


def _same_host(a, b) -> bool:
    """Addresses compare as addresses (::1 == 0:0::1), names case-insensitively."""
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()


@dataclass(frozen=True)
class Destination:
    """The worker a request is meant for (`to` in the signed body), or this worker's own identity.
    A request's fields are kept as sent (any JSON) and compared, never trusted."""

    engine_id: Any
    host: Any
    port: Any

    @classmethod
    def of_request(cls, body: dict) -> "Destination":
        to = body.get("to")
        if not isinstance(to, dict):
            raise PermissionError("the request names no destination (`to`): refused")
        return cls(to.get("engine_id"), to.get("host"), to.get("port"))

    def to_body(self) -> dict:
        return {"engine_id": self.engine_id, "host": self.host, "port": self.port}

    def names(self, me: "Destination", describe: bool) -> bool:
        """Is `me` the worker this names? Only a describe (layout only) may leave the engine out."""
        engine_ok = self.engine_id == me.engine_id or (describe and self.engine_id is None)
        # type() is int: a bool equals 0 or 1, and a float port names no port.
        port_ok = type(self.port) is int and self.port == me.port
        return engine_ok and port_ok and _same_host(self.host, me.host)

    def __str__(self) -> str:
        return f"engine {str(self.engine_id)[:40]} at {str(self.host)[:80]}:{str(self.port)[:8]}"


# -- requests, as the prefill side reads them ---------------------------------------------------


class _Indexed:
    """A request for blocks of a pin by their positions (`indices`)."""

    indices: Any

    @property
    def waits_for(self) -> list | None:
        """The blocks a streamed pin defers the request until computed (None: not a list; refused later)."""
        return self.indices if isinstance(self.indices, list) else None


@dataclass(frozen=True)
class LeaseRequest(_Indexed):
    request_id: Any
    token: Any
    prompt_digest: Any
    indices: Any  # positions in the pin; checked against it (block_runs.check_indices)
    want_metadata: bool  # the reader lacks the transport's metadata: send it with the lease

    @classmethod
    def from_body(cls, body: dict) -> "LeaseRequest":
        return cls(body.get("request_id"), body.get("token"), body.get("prompt_digest"), body.get("indices"),
                   bool(body.get("want_metadata")))

    def to_body(self) -> dict:
        return {"request_id": self.request_id, "token": self.token, "indices": self.indices,
                "prompt_digest": self.prompt_digest, "want_metadata": self.want_metadata}



@dataclass(frozen=True)
class ProgressRequest:
    request_id: Any
    token: Any
    prompt_digest: Any
    have: Any  # ready blocks the reader has seen: answer once there are more
    last_seen: Any = True  # False: also answer as soon as the prefill's last step begins
    layers: Any = None  # a layered reader holds this many layers of the blocks being written
    lease: bool = False  # the reply also leases the pin (a leasing transport)
    want_metadata: bool = False
    deadline: bool = False  # set by the side channel: the deferral ran out, answer with what there is

    @classmethod
    def from_body(cls, body: dict) -> "ProgressRequest":
        return cls(body.get("request_id"), body.get("token"), body.get("prompt_digest"), body.get("have"),
                   body.get("last_seen", True), body.get("layers"), bool(body.get("lease")),
                   bool(body.get("want_metadata")), bool(body.get("deadline")))

    def to_body(self) -> dict:
        body = {"request_id": self.request_id, "token": self.token, "prompt_digest": self.prompt_digest,
                "have": self.have, "last_seen": self.last_seen}
        if self.layers is not None:
            body["layers"] = self.layers
        if self.lease:
            body.update(lease=True, want_metadata=self.want_metadata)
        return body


@dataclass(frozen=True)
class ReleaseRequest:
    request_id: Any
    token: Any

    @classmethod
    def from_body(cls, body: dict) -> "ReleaseRequest":
        return cls(body.get("request_id"), body.get("token"))

    def to_body(self) -> dict:
        return {"request_id": self.request_id, "token": self.token}


@dataclass(frozen=True)
class ReadRequest(_Indexed):
    """TCP's `read`: the blocks at `indices`, inline in the reply or (`data`) over data connections."""

    request_id: Any
    token: Any
    prompt_digest: Any
    indices: Any
    keep: bool = False  # leave the pin for an explicit release (else the read is the release)
    data: bool = False
    streams: Any = None  # data connections asked for
    stream: bool = False  # granted at once, sent as the prefill computes the blocks
    layers: bool = False  # a stream read's pieces may be layers of a block being written

    @classmethod
    def from_body(cls, body: dict) -> "ReadRequest":
        return cls(body.get("request_id"), body.get("token"), body.get("prompt_digest"), body.get("indices"),
                   bool(body.get("keep")), bool(body.get("data")), body.get("streams"), body.get("stream") is True,
                   body.get("layers") is True)

    def to_body(self) -> dict:
        body = {"request_id": self.request_id, "token": self.token, "indices": self.indices,
                "prompt_digest": self.prompt_digest}
        if self.keep:
            body["keep"] = True
        if self.data:
            body["data"], body["streams"] = True, self.streams
            if self.stream:
                body["stream"], body["layers"] = True, self.layers
        return body



@dataclass(frozen=True)
class ReleaseNotice:
    """A NIXL notification a reader sends once its READ landed: it also releases the pin."""

    request_id: str
    token: str
    nbytes: int

    @classmethod
    def parse(cls, msg) -> "ReleaseNotice | None":
        """None: not a release (ignored, as any other notification)."""
        if not isinstance(msg, dict) or msg.get("op") != "release":
            return None
        return cls(msg.get("request_id", ""), msg.get("token", ""), msg.get("bytes", 0))

    def to_body(self) -> dict:
        return {"op": "release", "request_id": self.request_id, "token": self.token, "bytes": self.nbytes}


# -- replies, as the decode side reads them ------------------------------------------------------


@dataclass(frozen=True)
class LeaseReply:
    engine_id: Any
    prompt_digest: Any
    tp_rank: Any
    block_ids: Any  # the caller compares them with the blocks it asked for
    metadata: dict | None  # the transport's, under its name (only when asked for)

    @classmethod
    def parse(cls, reply: dict, where: str, engine_id: str, digest: str, transport: str,
              want_metadata: bool) -> "LeaseReply":
        _check_peer(reply, where, engine_id, digest)
        metadata = reply.get(transport)
        if want_metadata and not isinstance(metadata, dict):
            raise MalformedReply(f"{where} sent no {transport.upper()} metadata")
        return cls(reply.get("engine_id"), reply.get("prompt_digest"), reply.get("tp_rank", 0),
                   reply.get("block_ids"), metadata)


@dataclass(frozen=True)
class ProgressReply:
    """A streamed pin's progress: `ready` leading blocks computed; `state` running, done or
    cancelled; `first_token_id` once done; `last` while its prefill runs the last step;
    `partial` (a layered reader only): [blocks, layers written, layers of the model] of the
    step running; a leasing reply also names the pin's `block_ids` (and the metadata)."""

    ready: int
    state: str
    first_token_id: Any = None
    last: bool = False
    partial: list[int] | None = None
    block_ids: list | None = None
    metadata: dict | None = None

    @classmethod
    def parse(cls, reply: dict, where: str, engine_id: str, digest: str, transport: str, lease: bool,
              want_metadata: bool) -> "ProgressReply":
        _check_peer(reply, where, engine_id, digest)
        ready, state = reply.get("ready"), reply.get("state")
        if type(ready) is not int or state not in STATES:
            raise MalformedReply(f"{where} sent a malformed progress reply")
        part = reply.get("partial")
        if part is not None and not (isinstance(part, list) and len(part) == 3 and all(type(x) is int for x in part)
                                     and ready < part[0] and 0 < part[1] < part[2]):
            raise MalformedReply(f"{where} sent a malformed partial step {part!r}")
        block_ids, metadata = reply.get("block_ids"), reply.get(transport)
        if lease and state != "cancelled":
            if not isinstance(block_ids, list):
                raise MalformedReply(f"{where} did not lease the streamed pin")
            if want_metadata and not isinstance(metadata, dict):
                raise MalformedReply(f"{where} sent no {transport.upper()} metadata")
        return cls(ready, state, reply.get("first_token_id"), reply.get("last") is True,
                   part, block_ids, metadata)


@dataclass(frozen=True)
class ReadGrant:
    """TCP's grant of a `read` with `data`: a one-time `ticket` for `streams` connections to the
    peer's `data_port`, carrying `nblocks` blocks of `block_bytes` in chunks of `chunk_blocks`;
    `stream`: a stream read (pieces with headers, sent as the prefill computes them) of `layers`
    pieces per block (0: whole blocks)."""

    ticket: bytes = field(repr=False)  # proves the data connections' claim: kept out of logs
    data_port: int
    nblocks: int
    block_bytes: int
    chunk_blocks: int
    streams: int
    stream: bool = False
    layers: int = 0


@dataclass(frozen=True)
class ReadReply:
    """TCP's reply to a `read`: a `grant` (the bytes follow over data connections) or, from a
    peer of an earlier release or to a read without `data`, the blocks inline: one frame per run
    of `runs[i]` blocks."""

    grant: ReadGrant | None = None
    runs: list[int] | None = None

    @classmethod
    def parse(cls, reply: dict, frame_bytes: list[int], where: str, digest: str, nblocks: int, block_bytes: int,
              max_streams: int, max_recv_bytes: int, max_layers: int) -> "ReadReply":
        """`frame_bytes`: the sizes of the frames that came with it. The grant must fit this pull
        (`nblocks` of our `block_bytes`) and the reader's bounds: a peer's numbers decide what we
        allocate. The data port is the peer's own (from its signed reply); the reader connects to
        the host it asked."""
        if reply.get("prompt_digest") != digest:  # a peer that skipped the check must not fill our cache
            raise MalformedReply("KV peer did not confirm the prompt digest")
        if "ticket" not in reply:
            runs = reply.get("runs")
            if (not isinstance(runs, list) or len(frame_bytes) != len(runs) or sum(runs) != nblocks
                    or any(n != c * block_bytes for n, c in zip(frame_bytes, runs))):
                raise MalformedReply(f"KV peer sent a malformed read reply ({len(frame_bytes)} frames for runs "
                                     f"{runs}, {nblocks} blocks of {block_bytes} bytes expected)")
            return cls(runs=runs)
        try:
            ticket = bytes.fromhex(reply["ticket"])
            fields = [reply[k] for k in ("nblocks", "block_bytes", "chunk_blocks", "streams", "data_port")]
        except (KeyError, TypeError, ValueError):
            raise MalformedReply(f"{where} sent a malformed read grant") from None
        if (len(ticket) != 16 or not all(type(f) is int for f in fields) or fields[0] != nblocks
                or fields[1] != block_bytes or not 1 <= fields[3] <= max_streams
                or not 1 <= fields[2] or 2 * fields[3] * fields[2] * block_bytes > max_recv_bytes
                or not 0 < fields[4] < 65536):
            raise MalformedReply(f"{where} sent a read grant that does not fit this pull "
                                 f"({nblocks} blocks of {block_bytes} bytes)")
        stream = reply.get("stream") is True
        layers = reply.get("layers", 0) if stream else 0
        if type(layers) is not int or not 0 <= layers <= max_layers or (layers and block_bytes % layers):
            raise MalformedReply(f"{where} granted a stream read of {layers!r} layers per {block_bytes}-byte block")
        n, bb, chunk, streams, port = fields
        return cls(grant=ReadGrant(ticket, port, n, bb, chunk, streams, stream, layers))


@dataclass(frozen=True)
class NixlPeer:
    """A NIXL peer's registered cache, as its lease or progress reply describes it (the NIXL
    transport's metadata): its agent's name and metadata, the cache's address, device and memory
    type; its block count and size, unless it is of an earlier release (None: its blocks are
    READ with descriptors built per pull; a block size other than ours: read into staging)."""

    agent: str
    # What NIXL's add_remote_agent takes (base64 on the wire): it grants READs of the whole
    # cache, so it stays out of logs.
    agent_metadata: bytes = field(repr=False)
    base: int
    device_id: int
    mem_type: str  # "VRAM" or "DRAM"
    num_blocks: int | None = None
    block_bytes: int | None = None

    @classmethod
    def parse(cls, desc, where: str) -> "NixlPeer":
        try:
            agent, base, device_id, mem_type = desc["agent"], desc["base"], desc["device_id"], desc["mem_type"]
            agent_metadata = base64.b64decode(desc["metadata"])
        except (KeyError, TypeError, ValueError):
            raise MalformedReply(f"{where} sent malformed NIXL metadata") from None
        num_blocks, block_bytes = desc.get("num_blocks"), desc.get("block_bytes")
        if (not isinstance(agent, str) or not isinstance(mem_type, str) or type(base) is not int
                or type(device_id) is not int or not (block_bytes is None or type(block_bytes) is int)):
            raise MalformedReply(f"{where} sent malformed NIXL metadata")
        return cls(agent, agent_metadata, base, device_id, mem_type,
                   num_blocks if type(num_blocks) is int and num_blocks > 0 else None, block_bytes)

    def to_body(self) -> dict:
        return {"agent": self.agent, "metadata": base64.b64encode(self.agent_metadata).decode(), "base": self.base,
                "device_id": self.device_id, "mem_type": self.mem_type, "num_blocks": self.num_blocks,
                "block_bytes": self.block_bytes}


def _check_peer(reply: dict, where: str, engine_id: str, digest: str) -> None:
    if reply.get("engine_id") != engine_id or reply.get("prompt_digest") != digest:
        raise MalformedReply(f"{where} is not engine {engine_id} or did not confirm the prompt digest")
