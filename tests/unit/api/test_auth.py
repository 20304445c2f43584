"""Owner ids: a keyed hash of the API key under the deployment secret."""

from __future__ import annotations

import hashlib
import hmac

from services.api.auth import owner_id


def test_owner_id_is_keyed_by_the_deployment_secret() -> None:
    assert owner_id("k") == hashlib.sha256(b"k").hexdigest()  # no secret: the unkeyed hash
    keyed = owner_id("k", "s1")
    assert keyed == hmac.new(b"s1", b"k", hashlib.sha256).hexdigest()
    assert keyed != owner_id("k") and keyed != owner_id("k", "s2")
    assert owner_id("other", "s1") != keyed
