"""Who shares the prefix cache: each API key is a tenant, and `cache_salt` partitions further.

The engine's page pool hashes every cached page with a salt (`jserve/page_pool.py`), so requests
with different salts never share a page: neither `usage.prompt_tokens_details.cached_tokens` nor
the timing headers can tell one tenant that another sent the same prompt. The salt given to the
engine is a digest of the tenant (the key's own digest, never the key) and the request's
`cache_salt`. Without API keys every client is one tenant: they share the cache unless they send
different `cache_salt`s (vLLM's behaviour).
"""

from __future__ import annotations

import hashlib

from aiohttp import web

# The tenant of a request, set by the auth middleware ("" when the server has no keys).
TENANT = web.RequestKey("tenant", str) if hasattr(web, "RequestKey") else "jserve_tenant"


def tenant_of_key(key: bytes) -> str:
    """A stable id for an API key that does not reveal it (logs, salts)."""
    return hashlib.sha256(b"jserve-tenant\0" + key).hexdigest()[:32]


def engine_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The salt the engine partitions the prefix cache by; None (shared) for the keyless tenant
    without a cache_salt."""
    if not tenant and cache_salt is None:
        return None
    return hashlib.sha256(repr((tenant, cache_salt)).encode()).hexdigest()
