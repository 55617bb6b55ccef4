"""API-key check: `Authorization: Bearer KEY` on /v1/* and the POST /strata control routes.

Compared in constant time. No key configured means no check (the server binds loopback by default, and
`strata-engine serve` warns when it binds anything else without a key).
"""

from __future__ import annotations

import hmac
import ipaddress

from engine.server.errors import ApiError


def check_bearer(authorization: str | None, api_key: str | None) -> None:
    """Raise a 401 ApiError unless `authorization` carries `api_key` (or no key is configured)."""
    if not api_key:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
