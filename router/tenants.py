"""Tenants own their caches: the cache salt of a request, derived from who sent it.

The router authenticates every client by its API key (`common.server.auth`); the key names a
tenant. The salt of the request's block hashes (prefill and decode) and of its encoder cache
keys is an HMAC of that tenant under the deployment's cluster key, so two tenants never share
a KV block or an encoder cache entry and no tenant can probe another's cache. A client's own
`cache_salt` is mixed in under the tenant's: it can split its own cache further (per user,
say), never reach into another tenant's. A tenant's `cache_epoch` (API keys file) is mixed
in as well: changing it orphans everything the tenant had cached, everywhere at once.
Without authentication (`--insecure`) there are no tenants: the client's `cache_salt` is
used as sent (none: one cache shared by everyone).
"""

from __future__ import annotations

import hashlib
import hmac


def tenant_salt(
    key: bytes | None, tenant: str | None, client_salt: str | None, epoch: str = ""
) -> str | None:
    """The cache salt of a request from `tenant` (None: unauthenticated) carrying
    `client_salt`, under the cluster `key`; a tenant's `epoch` (its keys' `cache_epoch`,
    "" for none) is salted in too, so a new one leaves the tenant's old caches behind (a
    tenant name given to someone else, say)."""
    if tenant is None:
        return client_salt
    message = [b"epd-tenant-salt-v1", tenant.encode()]
    if epoch:  # its own tag: the parts after the tenant cannot be read two ways
        message = [b"epd-tenant-salt-v2", tenant.encode(), epoch.encode()]
    if client_salt is not None:
        message.append(client_salt.encode())
    body = b"".join(len(part).to_bytes(4, "big") + part for part in message)
    return "tenant:" + hmac.new(key or b"", body, hashlib.sha256).hexdigest()
