"""Who is calling: each public call's tenant, from its API key or its client certificate.

AuthInterceptor authenticates every call of the Inference service before its handler runs
and keeps the tenant for `tenant_of`; grpc.health.v1 and reflection stay open. Three modes
(--auth):
- keys: `authorization: Bearer <API key>`; the key's record in Redis names the tenant.
- cert: mutual TLS; the client certificate's subject common name (CN) is the tenant.
- off: every caller is the tenant `default` (local use).
A key's record is cached for --auth-cache-s, so a revoked key stops working that long after.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from grpc import aio

from common.keys import RedisKeys
from common.tenants import (
    DEFAULT_TENANT,
    KEY_SHA256_FIELD,
    KEY_TENANT_FIELD,
    TENANT_PATTERN,
    key_id_of,
    key_matches,
)
from gateway.errors import Unauthenticated, WrappingInterceptor

AUTH_MODES = ("keys", "cert", "off")
# Calls of these services need credentials; every other service of the public port is open.
GUARDED_PREFIXES = ("/kvgate.v1.Inference/", "/vllm.grpc.engine.VllmEngine/")
AUTHORIZATION = "authorization"
BEARER = "bearer "
# Cached key records past this many are dropped, oldest reads first (unknown ids included).
MAX_CACHED_KEYS = 10_000

_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default=DEFAULT_TENANT)


def tenant_of(context: aio.ServicerContext) -> str:
    """The tenant of the calling client, as AuthInterceptor authenticated it."""
    return _tenant.get()


@dataclass(frozen=True, slots=True)
class _KeyRecord:
    tenant: str | None  # None: no such key (never made, or revoked)
    sha256: str
    read_at: float  # time.monotonic() of the Redis read


class ApiKeys:
    """API key -> tenant, read from Redis and cached for `cache_s`."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, cache_s: float) -> None:
        self.client = client
        self.keys = keys
        self.cache_s = cache_s
        self._records: dict[str, _KeyRecord] = {}

    async def tenant(self, api_key: str) -> str | None:
        """The tenant of `api_key`; None when it is no key of ours, unknown or revoked."""
        key_id = key_id_of(api_key)
        if key_id is None:
            return None
        record = self._records.get(key_id)
        if record is None or time.monotonic() - record.read_at > self.cache_s:
            record = await self._read(key_id)
        if record.tenant is None or not key_matches(api_key, record.sha256):
            return None
        return record.tenant

    async def _read(self, key_id: str) -> _KeyRecord:
        stored = await self.client.hgetall(self.keys.api_key(key_id))
        tenant = stored.get(KEY_TENANT_FIELD.encode())
        record = _KeyRecord(
            tenant.decode() if tenant else None,
            stored.get(KEY_SHA256_FIELD.encode(), b"").decode(),
            time.monotonic(),
        )
        self._records.pop(key_id, None)
        self._records[key_id] = record
        while len(self._records) > MAX_CACHED_KEYS:
            del self._records[next(iter(self._records))]
        return record


def bearer_key(authorization: str | None) -> str:
    """The API key of an `authorization` value (None: the caller sent none).

    Raises:
        Unauthenticated: none sent, or not `Bearer <API key>`.
    """
    if authorization is None:
        raise Unauthenticated("authorization: missing; send 'authorization: Bearer <API key>'")
    if not authorization.lower().startswith(BEARER):
        raise Unauthenticated("authorization: expected 'Bearer <API key>'")
    return authorization[len(BEARER) :].strip()


def _bearer_key(context: aio.ServicerContext) -> str:
    for name, value in context.invocation_metadata() or ():
        if name == AUTHORIZATION:
            return bearer_key(value)
    return bearer_key(None)


def certificate_tenant(context: aio.ServicerContext) -> str:
    """The tenant a verified client certificate names: its subject common name.

    Raises:
        Unauthenticated: no client certificate, or a CN that is not a tenant name.
    """
    names = context.auth_context().get("x509_common_name") or []
    if not names:
        raise Unauthenticated("client certificate: none presented (mutual TLS is required)")
    tenant = names[0].decode(errors="replace")
    if not TENANT_PATTERN.fullmatch(tenant):
        raise Unauthenticated("client certificate: its CN is not a tenant name")
    return tenant


class Authenticator:
    """The tenant of a call under one --auth mode."""

    def __init__(self, mode: str, api_keys: ApiKeys | None) -> None:
        if mode not in AUTH_MODES:
            raise ValueError(f"--auth must be one of {', '.join(AUTH_MODES)}; got {mode!r}")
        if mode == "keys" and api_keys is None:
            raise ValueError("--auth keys needs the API keys in Redis")
        self.mode = mode
        self.api_keys = api_keys

    async def tenant(self, context: aio.ServicerContext) -> str:
        """Raises: Unauthenticated when the call's credentials name no tenant."""
        if self.mode == "off":
            return DEFAULT_TENANT
        if self.mode == "cert":
            return certificate_tenant(context)
        return await self.key_tenant(_bearer_key(context))

    async def key_tenant(self, api_key: str) -> str:
        """The tenant of an API key under --auth keys or off (cert needs a TLS peer).

        Raises:
            Unauthenticated: the key is unknown or revoked.
        """
        if self.mode == "off":
            return DEFAULT_TENANT
        tenant = await self.api_keys.tenant(api_key)
        if tenant is None:
            raise Unauthenticated("authorization: unknown or revoked API key")
        return tenant


class AuthInterceptor(WrappingInterceptor):
    """Authenticates the Inference and VllmEngine calls; sits inside ErrorInterceptor, which
    turns its Unauthenticated into the status."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    def wraps(self, method: str) -> bool:
        return method.startswith(GUARDED_PREFIXES)

    def wrap_unary(self, behavior: Callable[..., Awaitable[Any]], method: str) -> Callable:
        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
            _tenant.set(await self.authenticator.tenant(context))
            return await behavior(request_or_iterator, context)

        return wrapper

    def wrap_stream(self, behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable:
        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator:
            # The call's own task runs it: the tenant set here is that task's alone.
            _tenant.set(await self.authenticator.tenant(context))
            async for response in behavior(request_or_iterator, context):
                yield response

        return wrapper
