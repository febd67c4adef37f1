"""Python client of kvgate and the `kvgate` command line."""

from client.api import ChatSession, Completion, KvgateClient

__all__ = ["ChatSession", "Completion", "KvgateClient"]
