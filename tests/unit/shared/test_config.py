"""Settings come from SLUICE_* variables; keys from the variable and a file."""

from __future__ import annotations

import msgspec
import pytest

from shared import keys
from shared.config import Settings


def test_defaults_and_environment_overrides(tmp_path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# ops keys\nk2\n\nk3\n")
    s = Settings.from_env(
        {
            "SLUICE_REDIS_URL": "redis://r:1/2",
            "SLUICE_PORT": "9000",
            "SLUICE_API_KEYS": "k1, ,k2",
            "SLUICE_API_KEYS_FILE": str(keyfile),
            "SLUICE_REASONING_WHEN_HIDDEN": "true",
            "UNRELATED": "x",
        },
        port=9100,
    )
    assert s.redis_url == "redis://r:1/2" and s.port == 9100 and s.reasoning_when_hidden
    assert s.all_api_keys() == {"k1", "k2", "k3"}
    assert Settings.from_env({}).api_keys == []


def test_bad_values_fail_loudly() -> None:
    with pytest.raises(msgspec.ValidationError):
        Settings.from_env({"SLUICE_PORT": "eighty"})


def test_per_request_keys_share_one_cluster_slot() -> None:
    rid = "req_abc"
    tagged = [keys.events(rid), keys.request(rid), keys.cancel(rid), keys.lease(rid)]
    assert all("{req_abc}" in k for k in tagged)
    assert len(set(tagged)) == len(tagged)


def test_events_and_queue_urls_default_to_the_redis_url() -> None:
    one = Settings.from_env({"SLUICE_REDIS_URL": "redis://r:1/2"})
    assert one.events_redis_url == one.queue_redis_url == "redis://r:1/2"
    split = Settings.from_env(
        {
            "SLUICE_REDIS_URL": "redis://r:1/2",
            "SLUICE_EVENTS_URL": "redis://events:6379/0",
            "SLUICE_QUEUE_URL": "redis://queue:6379/0",
        }
    )
    assert split.events_redis_url == "redis://events:6379/0"
    assert split.queue_redis_url == "redis://queue:6379/0"
