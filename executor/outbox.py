"""What the step loop sends its gateways: the requests it runs and where their tokens go, and
each one's RequestTokens entry of this step, gathered per gateway and sent as one TokenBatch on
that gateway's TokenSink stream (executor/gateway_link.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.sampler import TokenLogprobs
from executor.gateway_link import GatewayEvent, GatewayLink, SinkCredentials
from protos.kvgate.v1 import inference_pb2, internal_pb2


@dataclass(slots=True)
class Tracked:
    """A request this executor runs, and where its tokens go."""

    reply_to: str  # TokenSink address of its gateway
    offset: int  # index in the completion of its next token
    tenant: str
    prompt_token_ids: list[int]
    session_id: str = ""  # empty: no session
    attempt: int = 0  # QueuedRequest.attempt, echoed in its output
    entry_id: str = ""  # its assignment's inbox entry, deleted once the request is done here
    # a choice of a request of several sequences: that request's id and the choice's index
    group_id: str = ""
    index: int = 0
    run: int = 0  # the number of the admission it runs in (RequestTokens.run)
    num_resumed: int = 0  # output tokens it was admitted with (QueuedRequest.resume_token_ids)


def to_logprobs_pb(logprobs: list[TokenLogprobs]) -> list[inference_pb2.TokenLogprob]:
    """Returns: the engine's logprobs as protobuf messages."""
    return [
        inference_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


class Outbox:
    """This step's RequestTokens entries by gateway, and the links to the gateways."""

    def __init__(
        self,
        executor_id: str,
        on_event: Callable[[GatewayEvent], None],
        credentials: SinkCredentials,
    ) -> None:
        self._executor_id = executor_id
        self._on_event = on_event  # aborts and ends of the gateways' streams
        self._credentials = credentials
        self._entries: dict[str, dict[str, internal_pb2.RequestTokens]] = {}
        self._links: dict[str, GatewayLink] = {}

    def entry(self, request_id: str, tracked: Tracked) -> internal_pb2.RequestTokens:
        """The request's entry of this step (a new one, at its offset, when it has none)."""
        entries = self._entries.setdefault(tracked.reply_to, {})
        entry = entries.get(request_id)
        if entry is None:
            entry = internal_pb2.RequestTokens(
                request_id=request_id,
                offset=tracked.offset,
                attempt=tracked.attempt,
                run=tracked.run,
            )
            entries[request_id] = entry
        return entry

    def drop(self, address: str, request_id: str) -> None:
        """Forget the request's entry of this step (it was aborted)."""
        self._entries.get(address, {}).pop(request_id, None)

    def flush(self) -> bool:
        """Sends one TokenBatch per gateway with pending entries. Returns: whether any went."""
        sent = False
        for address, entries in self._entries.items():
            if entries:
                batch = internal_pb2.TokenBatch(requests=list(entries.values()))
                self._link(address).send(batch)
                sent = True
        self._entries.clear()
        return sent

    def forget_gateway(self, address: str) -> None:
        """Close the link to a gateway that is gone, and drop its entries."""
        link = self._links.pop(address, None)
        if link is not None:
            link.close()
        self._entries.pop(address, None)

    def close(self) -> None:
        for link in self._links.values():
            link.close()

    def _link(self, address: str) -> GatewayLink:
        link = self._links.get(address)
        if link is None:
            link = GatewayLink(address, self._executor_id, self._on_event, self._credentials)
            self._links[address] = link
        return link
