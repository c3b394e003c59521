"""The Secret holding a service's admin token, and the token itself."""

from __future__ import annotations

import base64
import hashlib
import hmac

from batchpilot.operator.children.meta import Owner, child_metadata

SECRET_TOKEN_KEY = "token"


def admin_token(key: bytes, owner: Owner) -> str:
    """The service's admin token: an HMAC of the operator's key and the object's identity.
    The operator recomputes it whenever it needs it and never reads it back, so it needs
    no right to read Secrets; a new object with the same name (a new uid) gets another."""
    identity = f"admin-token\0{owner.namespace}\0{owner.name}\0{owner.uid}".encode()
    digest = hmac.new(key, identity, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def secret_name(name: str, token: str) -> str:
    """The Secret holding ``token``, named after a hash of it: no one without the operator's
    key can tell the name before the operator creates it, so no one can have put another
    Secret there; a new token (a new key) is a new Secret, and the pods roll to it."""
    return f"{name}-admin-{hashlib.sha256(token.encode()).hexdigest()[:12]}"


def build_secret(owner: Owner, token: str) -> dict:
    """The admin API's bearer token, for the pods' environment; created once, never
    changed (its name changes with the token)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(owner, secret_name(owner.name, token)),
        "type": "Opaque",
        "immutable": True,
        "data": {SECRET_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }
