"""Tenants: each request belongs to one. Until API keys land every caller is `default`."""

from __future__ import annotations

from grpc import aio

DEFAULT_TENANT = "default"


def tenant_of(context: aio.ServicerContext) -> str:
    """The tenant of the calling client."""
    return DEFAULT_TENANT
