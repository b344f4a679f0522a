"""The operator's settings (server/node/config.py): what is derived from a flag is derived in one place."""

from __future__ import annotations

from mqks.server.node.config import Config


def test_log_urls_are_read_from_the_flag_once_for_every_user():
    """cli.serve_groups, the supervisor's layout check and the Server's stream and log lines all read this."""
    config = Config(log="nats://a:4222, b:4223,,")
    assert config.log_urls == ["nats://a:4222", "nats://b:4223"]
    assert Config().log_urls == []
