"""A client's settings (client/linking.py `ClientSettings`), shared by both clients: the keyword options and the
settings object are one list with one set of defaults, either way of giving them makes the same client, and the
two cannot be mixed. In process: a client made, never connected."""

from __future__ import annotations

import dataclasses
import inspect
import ssl

import pytest

from mqks import aio
from mqks.client import Client, ClientSettings
from mqks.client.linking import ClientBase

pytestmark = pytest.mark.timeout(10)


def test_the_keyword_options_are_the_settings_fields_with_the_same_defaults():
    """One list: an option added to ClientSettings but not to the constructor (or the other way) fails here."""
    parameters = inspect.signature(ClientBase.__init__).parameters
    options = {name: parameter.default for name, parameter in parameters.items()
               if name not in ("self", "host", "port", "settings", "on_refused")}
    fields = {field.name: field.default for field in dataclasses.fields(ClientSettings)}
    assert options == fields


@pytest.mark.parametrize("client_class", [Client, aio.Client], ids=["gevent", "aio"])
def test_settings_make_the_client_its_options_would(client_class: type[ClientBase]):
    settings = ClientSettings(ping_seconds=2.0, timeout_seconds=3.0, token="secret", fallbacks=[("b", 2)],
                              failover_seconds=4.0)
    given = client_class("a", 1, settings=settings)
    spelled = client_class("a", 1, ping_seconds=2.0, timeout_seconds=3.0, token="secret", fallbacks=[("b", 2)],
                           failover_seconds=4.0)
    assert given.settings == spelled.settings == settings
    assert (given.timeout_seconds, given.failover_seconds) == (spelled.timeout_seconds, spelled.failover_seconds)
    assert given._link.addresses == spelled._link.addresses == [("a", 1), ("b", 2)]
    assert given._link_options == spelled._link_options
    assert given._link.token == b"secret" and given._link.ttl_seconds == 4.0
    assert not given.connected and given.reconnects == 0 and given.server_info is None


@pytest.mark.parametrize("client_class", [Client, aio.Client], ids=["gevent", "aio"])
def test_settings_and_an_option_beside_them_are_refused(client_class: type[ClientBase]):
    with pytest.raises(TypeError, match="not both"):
        client_class(settings=ClientSettings(), timeout_seconds=1.0)


def test_settings_are_frozen_and_hold_their_fallbacks_as_a_tuple():
    settings = ClientSettings(fallbacks=[("b", 2)])  # a list, as Client(...) takes
    assert settings.fallbacks == (("b", 2),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.timeout_seconds = 1.0


def test_a_ping_slower_than_the_ttl_is_refused_when_the_settings_are_made():
    with pytest.raises(ValueError, match="must not exceed ttl_seconds"):
        ClientSettings(ping_seconds=10.0, ttl_seconds=5.0)


def test_link_options_fill_in_what_follows_from_the_others(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MQKS_AUTH_TOKEN", "from-env")
    options = ClientSettings(ping_seconds=3.0, tls=True).link_options()
    assert options["ping_timeout_seconds"] == 3.0 and options["ttl_seconds"] == 6.0
    assert options["token"] == b"from-env" and isinstance(options["tls"], ssl.SSLContext)
    assert ClientSettings(ttl_seconds=0).link_options()["ttl_seconds"] == 0
