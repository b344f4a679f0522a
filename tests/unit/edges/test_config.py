"""The operator's settings (server/edges/config.py): what is derived from a flag is derived in one place."""

from __future__ import annotations

from mqks.server.edges.config import Config


def test_log_urls_are_read_from_the_flag_once_for_every_user():
    """cli.serve_groups, the supervisor's layout check and the Server's stream and log lines all read this."""
    config = Config(log="nats://a:4222, b:4223,,")
    assert config.log_urls == ["nats://a:4222", "nats://b:4223"]
    assert Config().log_urls == []


def test_nats_options_come_from_the_log_flags_and_the_environment(monkeypatch):
    """cli.serve_groups and the Server's JetStream log connect with these; no copy of the expression at each."""
    monkeypatch.setenv("MQKS_NATS_USER", "n1")
    monkeypatch.setenv("MQKS_NATS_PASSWORD", "secret")
    options = Config(log="tls://a:4222", log_creds="/dev/null").nats_options()
    assert options["user"] == "n1" and options["password"] == "secret"
    assert options["user_credentials"] == "/dev/null" and "tls" in options
    monkeypatch.delenv("MQKS_NATS_USER")
    assert Config(log="nats://a:4222").nats_options() == {}
