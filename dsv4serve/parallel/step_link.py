"""Rank 0's word to the other ranks: the step plan every rank runs, and the tokens rank 0 sampled.

    link = StepLink(group)                  # over group.control (gloo: host data, on CUDA too)
    rank 0:  link.send(RunStep(plan))       # before its own forward of the plan; Ping() when idle; Stop()
             link.share_tokens(tokens)      # after sampling: the other ranks take rank 0's tokens
    others:  msg = link.recv()              # RunStep | Ping | Stop
             tokens = link.share_tokens()

The scheduler runs on rank 0 alone; the others run the same forward on the same plan (their collectives meet
rank 0's) and never sample: sampling draws from random generators, and one draw must decide every rank's
tokens (a penalty, a grammar and the MTP block read the tokens a request produced). Messages are typed
msgspec structs, msgpack-encoded, sent as a length then the bytes (two broadcasts from rank 0).
"""

from __future__ import annotations

import msgspec
import torch

from dsv4serve.ipc.messages import TokenOut
from dsv4serve.parallel.group import RankGroup
from dsv4serve.worker.step import StepPlan


class RunStep(msgspec.Struct, frozen=True, tag="step", forbid_unknown_fields=True):
    plan: StepPlan


class Ping(msgspec.Struct, frozen=True, tag="ping", forbid_unknown_fields=True):
    """Rank 0 idle: keeps the other ranks' wait within the group's collective timeout."""


class Stop(msgspec.Struct, frozen=True, tag="stop", forbid_unknown_fields=True):
    """The server is shutting down: leave the loop and the group."""


class StepTokens(msgspec.Struct, frozen=True, tag="tokens", forbid_unknown_fields=True):
    tokens: dict[str, tuple[TokenOut, ...]]  # request id -> what it sampled this step (runner's _sample_step)


RankMessage = RunStep | Ping | Stop


class StepLink:
    def __init__(self, group: RankGroup):
        if group.size < 2:
            raise ValueError("a step link joins two or more ranks")
        self.group = group
        self._encoder = msgspec.msgpack.Encoder()
        self._messages = msgspec.msgpack.Decoder(RankMessage)
        self._tokens = msgspec.msgpack.Decoder(StepTokens)
        self.messages_sent = 0  # rank 0: messages of every kind, tokens included (tests, logs)

    @property
    def root(self) -> bool:
        return self.group.rank == 0

    def send(self, message: RunStep | Ping | Stop) -> None:
        self._broadcast(self._encoder.encode(message))

    def recv(self) -> RunStep | Ping | Stop:
        return self._messages.decode(self._broadcast(None))

    def share_tokens(self, tokens: dict[str, tuple[TokenOut, ...]] | None = None) -> dict[str, tuple[TokenOut, ...]]:
        """Rank 0 gives its sampled tokens (returned as given), every other rank gets them."""
        if self.root:
            assert tokens is not None, "rank 0 shares what it sampled"
            self._broadcast(self._encoder.encode(StepTokens(tokens)))
            return tokens
        return dict(self._tokens.decode(self._broadcast(None)).tokens)

    def _broadcast(self, payload: bytes | None) -> bytes:
        import torch.distributed as dist  # lazy: a link exists only in a group, which has it loaded

        pg = self.group.control
        if self.root:
            assert payload is not None
            size = torch.tensor([len(payload)], dtype=torch.int64)
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self.messages_sent += 1
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=pg)
        if not self.root:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=pg)
        return payload if payload is not None else data.numpy().tobytes()
