"""How an `mqks` command ends (issue 55): a refusal by the broker exits 1 whether the command waited for its answer
or not, and a reader that closes the output (`| head -1`) ends a command quietly with 0. Run as subprocesses the
way a user runs them; every read from a subprocess has a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import BrokerProcess
from helpers import mqks, unique

ORDERS = "orders-s3cret-0123456789"
ADMIN = "admin-s3cret-0123456789"
TOKENS_TOML = f"""
[[token]]
name = "orders"
secret = "{ORDERS}"
publish = ["orders.*"]
consume = ["orders-*"]
manage = false

[[token]]
name = "admin"
secret = "{ADMIN}"
publish = ["*"]
consume = ["*"]
manage = true
"""


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def scoped(request, tmp_path_factory) -> Iterator[BrokerProcess]:
    """A broker with scoped tokens (docs/operating.md): `orders` may publish orders.* and consume orders-*, no more."""
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(TOKENS_TOML)
    server = BrokerProcess("--auth-token-file", str(path), "--workers", str(request.param))
    yield server
    server.kill()


def test_every_command_the_broker_refuses_exits_1_with_its_reason(scoped: BrokerProcess) -> None:
    """Each command below gets an error answer, and exits 1 naming it. Before issue 55 a publish without --confirm
    (refused by scope, or `--mandatory` with no queue bound) logged a WARNING and exited 0: its error came while
    close() waited for its barrier, and nothing made it the exit code."""
    queue = unique("payments")  # a queue `orders` may not touch, made by `admin`
    for made in (queue, f"{queue}.dead"):
        done = mqks(scoped, "rebind", made, f"{made}.e", "--token", ADMIN)
        assert done.returncode == 0, done.stderr
    refusals = {
        "publish": ["publish", "payments.x", "y"],
        "publish --mandatory": ["publish", f"orders.{unique('unbound')}", "y", "--mandatory"],
        "publish --confirm": ["publish", "--confirm", "payments.x", "y"],
        "consume": ["consume", queue, "payments.x"],
        "request": ["request", "payments.x", "y"],
        "schedule": ["schedule", "s1", "payments.x", "y", "--every", "5"],
        "unschedule": ["unschedule", "s1"],
        "rebind": ["rebind", queue, "payments.x"],
        "delete-queue": ["delete-queue", queue],
        "purge": ["purge", queue],
        "requeue-dead": ["requeue-dead", queue],
    }
    ended = {name: mqks(scoped, *command, "--token", ORDERS) for name, command in refusals.items()}
    codes = {name: done.returncode for name, done in ended.items()}
    assert codes == dict.fromkeys(refusals, 1), {name: done.stderr for name, done in ended.items()}
    for name, done in ended.items():
        reason = "no queue is bound to" if name == "publish --mandatory" else "permission denied: token 'orders'"
        assert done.stderr.startswith(f"mqks {refusals[name][0]}: 127.0.0.1:{scoped.port} answered error "), done.stderr
        assert reason in done.stderr and "WARNING" not in done.stderr and "Traceback" not in done.stderr, done.stderr
