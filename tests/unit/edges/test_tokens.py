"""The token file (server/edges/sessions.py) in process: plain lines, TOML tables with scopes and secret_sha256,
the cluster's link secret, and reloads that keep the old tokens when the new file is wrong."""

from __future__ import annotations

import hashlib

import pytest

from mqks.server.edges.sessions import Tokens


def test_plain_lines_are_full_access_tokens_named_by_their_line(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# a comment\nfirst-token\n\nsecond-token\n")
    tokens = Tokens(str(path), None)
    assert tokens.tokens == [b"first-token", b"second-token"]
    found = tokens.find(b"second-token")
    assert found is not None and found.name == "line 4" and found.scope is None
    assert tokens.find(b"second") is None and tokens.find(b"") is None
    assert tokens.check_link(b"first-token")  # no cluster secret: a full-access token opens a link


def test_toml_tables_give_names_scopes_hashed_secrets_and_a_cluster_secret(tmp_path):
    digest = hashlib.sha256(b"hashed-secret").hexdigest()
    path = tmp_path / "tokens.toml"
    path.write_text(f'[[token]]\nname = "orders"\nsecret = "orders-secret"\npublish = ["orders.*"]\n'
                    f'[[token]]\nname = "admin"\nsecret_sha256 = "{digest.upper()}"\npublish = ["*"]\n'
                    f'consume = ["*"]\nmanage = true\n'
                    f'[cluster]\nsecret = "cluster-secret-0123456789"\n')
    tokens = Tokens(str(path), "from-the-env")
    orders = tokens.find(b"orders-secret")
    assert orders is not None and orders.scope is not None and orders.scope.may_publish(b"orders.x")
    assert not orders.scope.may_consume(b"anything") and not orders.scope.manage  # what is absent is denied
    admin = tokens.find(b"hashed-secret")
    assert admin is not None and admin.name == "admin" and admin.scope is None  # everything: full access
    assert tokens.tokens == [b"from-the-env", b"orders-secret"]  # a hashed one has no secret to give
    assert tokens.find(b"from-the-env") is not None
    assert tokens.check_link(b"cluster-secret-0123456789")
    assert not tokens.check_link(b"from-the-env")  # with a cluster secret, a user's token opens no link


def test_a_reload_takes_a_good_file_and_keeps_the_old_tokens_for_a_wrong_one(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text('[[token]]\nname = "a"\nsecret = "secret-a"\n')
    tokens = Tokens(str(path), None)
    path.write_text('[[token]]\nname = "b"\nsecret = "secret-b"\n')
    tokens.reload()
    assert tokens.check(b"secret-b") and not tokens.check(b"secret-a")
    path.write_text('[[token]]\nname = "c"\n')  # no secret: wrong
    tokens.reload()
    assert tokens.check(b"secret-b")


@pytest.mark.parametrize("body", ['[[token]]\nname = "a"\nsecret = "s"\nmanage = "yes"\n',
                                  '[[token]]\nname = "a"\nsecret = "s"\npublish = "orders.*"\n',
                                  '[[token]]\nsecret = "s"\n', '[tokens]\nname = "a"\n'])
def test_a_wrong_table_is_refused(tmp_path, body):
    path = tmp_path / "tokens.toml"
    path.write_text(body)
    with pytest.raises(ValueError):
        Tokens(str(path), None)


SCOPED = '[[token]]\nname = "orders"\nsecret = "orders-secret"\npublish = ["orders.*"]\n'


@pytest.mark.parametrize("name", ["tokens.conf", "tokens.toml.bak", "tokens"])
def test_a_toml_file_is_scoped_whatever_its_name(tmp_path, name):
    path = tmp_path / name
    path.write_text(SCOPED + '[[token]]\nname = "admin"\nsecret = "admin-secret"\npublish = ["*"]\n'
                    'consume = ["*"]\nmanage = true\n')
    tokens = Tokens(str(path), None)
    assert tokens.find(b"[[token]]") is None and tokens.find(b'name = "orders"') is None  # no line is a token
    orders = tokens.find(b"orders-secret")
    assert orders is not None and orders.scope is not None and not orders.scope.may_publish(b"payments.x")
    assert tokens.describe() == "2 tokens (1 scoped)"


def test_a_cluster_table_alone_makes_a_file_toml(tmp_path):
    path = tmp_path / "secrets.conf"
    path.write_text('[cluster]\nsecret = "cluster-secret-0123456789"\n[[token]]\nname = "a"\nsecret = "s"\n')
    tokens = Tokens(str(path), None)
    assert tokens.cluster_secret == b"cluster-secret-0123456789" and tokens.tokens == [b"s"]


@pytest.mark.parametrize("line", ["[[token]]", "[cluster]", 'name = "orders"', "secret=abc", "it's", '"quoted"'])
def test_a_plain_file_with_a_line_that_looks_like_toml_is_refused_by_its_number_not_its_content(tmp_path, line):
    path = tmp_path / "tokens"
    path.write_text(f"# comment\nfirst-secret-token\n{line}\n")
    with pytest.raises(ValueError) as refused:
        Tokens(str(path), None)
    message = str(refused.value)
    assert message.startswith(f"{path}: line 3 looks like TOML") and line not in message
    assert "first-secret-token" not in message


def test_a_broken_toml_file_under_another_name_is_refused_without_its_words(tmp_path):
    path = tmp_path / "tokens.conf"
    path.write_text(SCOPED + 'secret = unquoted-s3cret\n')  # a value TOML refuses, and a key given twice
    with pytest.raises(ValueError) as refused:
        Tokens(str(path), None)
    message = str(refused.value)
    assert "line 1 looks like TOML" in message and "TOML stops at line 5" in message
    assert "s3cret" not in message and "orders-secret" not in message


@pytest.mark.parametrize("body", ["abc123==\n", "c2VjcmV0LXRva2Vu\nQUJD=\n"])
def test_base64_padding_is_no_toml(tmp_path, body):
    path = tmp_path / "tokens"
    path.write_text(body)
    assert Tokens(str(path), None).tokens == body.encode().split()


def test_a_toml_named_file_that_is_not_toml_stays_an_error(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text("plain-token\n")
    with pytest.raises(ValueError, match="not TOML"):
        Tokens(str(path), None)


def test_a_reload_keeps_the_old_tokens_when_a_plain_file_gets_a_toml_looking_line(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text("old-token\n")
    tokens = Tokens(str(path), None)
    path.write_text("new-token\n[[token]]\n")
    tokens.reload()
    assert tokens.check(b"old-token") and not tokens.check(b"new-token") and not tokens.check(b"[[token]]")
    assert f"{path}: line 2 looks like TOML" in caplog.text and "[[token]]" not in caplog.text


def test_every_token_counts_once_whichever_its_kind(tmp_path, caplog):
    digest = hashlib.sha256(b"hashed-secret").hexdigest()
    path = tmp_path / "tokens.toml"
    path.write_text(SCOPED + f'[[token]]\nname = "hashed"\nsecret_sha256 = "{digest}"\nconsume = ["q"]\n'
                    '[[token]]\nname = "admin"\nsecret = "admin-secret"\npublish = ["*"]\nconsume = ["*"]\n'
                    'manage = true\n')
    tokens = Tokens(str(path), "from-the-env")
    assert tokens.describe() == "4 tokens (2 scoped)"  # the env token and the secret_sha256 one count too
    caplog.set_level("INFO")
    tokens.reload()
    assert "token file re-read: 4 tokens (2 scoped)" in caplog.text


def test_failed_auths_slow_their_address_down_growing_then_capped_and_a_success_forgives():
    from mqks.server.edges.sessions import MAX_DELAY_SECONDS, AuthThrottle

    now = [1000.0]
    throttle = AuthThrottle(clock=lambda: now[0])
    delays = [throttle.failed("10.0.0.9")[1] for _ in range(10)]
    assert delays[:3] == [0.0, 0.0, 0.0]  # a few typos are free
    assert delays[3:7] == [0.5, 1.0, 2.0, 4.0] and delays[-1] == MAX_DELAY_SECONDS
    # the waits queue up: parallel connections from the address wait their turns
    assert throttle.wait_seconds("10.0.0.9") == pytest.approx(sum(delays))
    assert throttle.wait_seconds("10.0.0.10") == 0.0  # another address is not slowed
    throttle.succeeded("10.0.0.9")
    assert throttle.wait_seconds("10.0.0.9") == 0.0
    for _ in range(4):
        throttle.failed("10.0.0.11")
    now[0] += 3600  # an hour later, the address starts afresh
    assert throttle.failed("10.0.0.11") == (1, 0.0)


def test_the_throttle_remembers_a_bounded_number_of_addresses(monkeypatch):
    from mqks.server.edges import sessions

    monkeypatch.setattr(sessions, "MAX_ADDRESSES", 50)
    throttle = sessions.AuthThrottle()
    for n in range(500):
        throttle.failed(f"10.0.{n // 256}.{n % 256}")
    assert len(throttle.failures) == 50
