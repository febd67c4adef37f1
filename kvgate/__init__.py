"""kvgate's Python clients under the project's name: `kvgate.KvgateClient` (blocking) and
`kvgate.AsyncClient` (asyncio), from client/."""

from client import AsyncChatSession, AsyncClient, ChatSession, Completion, KvgateClient

__all__ = ["AsyncChatSession", "AsyncClient", "ChatSession", "Completion", "KvgateClient"]
