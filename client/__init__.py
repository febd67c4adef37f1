"""Python client of kvgate and the `kvgate` command line."""

from client.api import ChatSession, Completion, KvgateClient
from client.async_api import AsyncChatSession, AsyncClient

__all__ = ["AsyncChatSession", "AsyncClient", "ChatSession", "Completion", "KvgateClient"]
