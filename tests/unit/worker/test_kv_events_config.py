"""--kv-events-config: vLLM's KVEventsConfig JSON, refused with the reason when wrong."""

from __future__ import annotations

import pytest

from worker.kv_events_zmq import KVEventsConfig


def test_vllms_fields_and_defaults() -> None:
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://*:6000", "replay_endpoint": '
                                 '"tcp://*:6001", "buffer_steps": 5, "hwm": 10, '
                                 '"max_queue_size": 7, "topic": "kv"}')
    assert c.enabled and (c.endpoint, c.replay_endpoint, c.buffer_steps, c.topic) == \
        ("tcp://*:6000", "tcp://*:6001", 5, "kv")
    d = KVEventsConfig.from_json("{}")
    assert not d.enabled and d.endpoint == "tcp://*:5557" and d.buffer_steps == 10_000
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled  # null


@pytest.mark.parametrize("text,match", [
    ("not json", "not JSON"), ("[1]", "JSON object"), ('{"endpont": "x"}', "unknown"),
    ('{"publisher": "kafka"}', "null or zmq"), ('{"hwm": "10"}', "hwm"),
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"), ('{"buffer_steps": 0}', ">= 1"),
])
def test_bad_config_names_the_problem(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVEventsConfig.from_json(text)
