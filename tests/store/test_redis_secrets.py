"""Redis passwords from a file or the environment, against a real redis-server that requires
one (`requirepass`); the inline URL form still works with a warning; no password in any log
line or error."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvgate.app
from kvgate.app import KvgateServer
from kvgate.config import ConfigError, parse_config
from kvgate.logs import JsonFormatter
from kvgate.store import RedisSettings
from kvgate.store.redis_store import connect
from testbed.harness import ManagedProcess, free_port
from testbed.redis_harness import REDIS_SERVER
from tests.session.conftest import make_config

PASSWORD = "redis-pw-7d1e0c9b4a2f"
SENTINEL_PASSWORD = "sentinel-pw-55aa33cc"


class PasswordRedis:
    """A private redis-server with `requirepass` (in its config file, not on its argv)."""

    def __init__(self, work_dir: Path) -> None:
        self.port = free_port()
        conf = work_dir / "redis.conf"
        conf.write_text(
            f'port {self.port}\nbind 127.0.0.1\ndir {work_dir}\nsave ""\nappendonly no\n'
            f"requirepass {PASSWORD}\n",
            encoding="utf-8",
        )
        self.process = ManagedProcess(
            f"redis-{self.port}", [REDIS_SERVER, str(conf)], log_dir=work_dir
        )

    def __enter__(self) -> PasswordRedis:
        self.process.start()
        self.process.wait_tcp(self.port, 15)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop(timeout=5)


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordRedis]:
    with PasswordRedis(tmp_path_factory.mktemp("redis-auth")) as server:
        yield server


def config_for(url: str, **redis: Any) -> dict[str, Any]:
    config = make_config()
    config["store"] = url
    config["redis"] = {"key_prefix": "kvgate-secrets-test", **redis}
    return config


async def store_answers(config: dict[str, Any]) -> bool:
    """Start kvgate on `config` and ask its store to reach Redis."""
    kvgate = KvgateServer(parse_config(config))
    await kvgate.start()
    try:
        return await kvgate.store.check()  # type: ignore[attr-defined]
    finally:
        await kvgate.stop()


def rendered_logs(caplog: pytest.LogCaptureFixture) -> str:
    formatter = JsonFormatter()
    return "\n".join(formatter.format(record) for record in caplog.records)


async def test_password_file_reaches_redis(
    redis_with_password: PasswordRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://127.0.0.1:{redis_with_password.port}/0"
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")  # as `kubectl create secret --from-file` often leaves it
    assert await store_answers(config_for(url, password_file=str(secret)))
    # The control: the same server refuses kvgate without the password, or with a wrong one.
    assert not await store_answers(config_for(url))
    secret.write_text("not-the-password\n")
    assert not await store_answers(config_for(url, password_file=str(secret)))
    assert PASSWORD not in rendered_logs(caplog)
    assert "inline" not in caplog.text  # no warning about the URL: it carries no password


async def test_password_env_reaches_redis(
    redis_with_password: PasswordRedis, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVGATE_TEST_REDIS_PASSWORD", PASSWORD)
    url = f"redis://127.0.0.1:{redis_with_password.port}/0"
    assert await store_answers(config_for(url, password_env="KVGATE_TEST_REDIS_PASSWORD"))
    # The user name may stay in the URL (Redis ACL): `default` is requirepass's user.
    url_with_user = f"redis://default@127.0.0.1:{redis_with_password.port}/0"
    assert await store_answers(config_for(url_with_user, password_env="KVGATE_TEST_REDIS_PASSWORD"))
    assert PASSWORD not in rendered_logs(caplog)


async def test_inline_url_password_still_works_with_a_warning(
    redis_with_password: PasswordRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://:{PASSWORD}@127.0.0.1:{redis_with_password.port}/0"
    assert await store_answers(config_for(url))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("inline" in w and "redis.password_file" in w for w in warnings), warnings
    assert PASSWORD not in rendered_logs(caplog)


def test_unreadable_secret_stops_kvgate_naming_the_field(tmp_path: Path, monkeypatch) -> None:
    url = "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigError, match=r"redis\.password_file: cannot read"):
        KvgateServer(parse_config(config_for(url, password_file=str(tmp_path / "absent"))))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"redis\.password_file: .* is empty"):
        KvgateServer(parse_config(config_for(url, password_file=str(tmp_path / "empty"))))
    monkeypatch.delenv("KVGATE_TEST_NO_REDIS_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match=r"redis\.password_env: .*KVGATE_TEST_NO_REDIS_PASSWORD"):
        KvgateServer(parse_config(config_for(url, password_env="KVGATE_TEST_NO_REDIS_PASSWORD")))


@pytest.mark.parametrize(
    ("url", "redis", "problem"),
    [
        (f"redis://:{PASSWORD}@h:6379/0", {"password_env": "P"}, "carries a password"),
        (f"redis://h:6379/0?password={PASSWORD}", {"password_file": "/p"}, "carries a password"),
        ("redis://h:6379/0", {"password_env": "P", "password_file": "/p"}, "not both"),
        (
            "redis://h:6379/0",
            {
                "sentinel": {
                    "master": "m",
                    "nodes": ["s:26379"],
                    "password": "x",
                    "password_env": "P",
                }
            },
            "set one of",
        ),
        ("redis://h:6379/0", {"password_env": "not a name"}, "password_env"),
    ],
)
def test_conflicting_password_settings_are_config_errors(
    url: str, redis: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(config_for(url, **redis))
    assert problem in str(raised.value)


def test_connect_uses_the_password_for_every_topology() -> None:
    plain = connect(RedisSettings(url="redis://127.0.0.1:1/0", password=PASSWORD))
    assert plain.connection_pool.connection_kwargs["password"] == PASSWORD
    cluster = connect(RedisSettings(url="redis://127.0.0.1:1/0", cluster=True, password=PASSWORD))
    assert cluster.nodes_manager.connection_kwargs["password"] == PASSWORD  # type: ignore[union-attr]
    sentinel = connect(
        RedisSettings(
            url="redis://kvgate@ignored:6379/2",
            sentinel_master="main",
            sentinel_nodes=(("127.0.0.1", 1),),
            sentinel_password=SENTINEL_PASSWORD,
            password=PASSWORD,
        )
    )
    master = sentinel.connection_pool.connection_kwargs
    assert (master["password"], master["username"], master["db"]) == (PASSWORD, "kvgate", 2)
    manager = sentinel.connection_pool.sentinel_manager  # type: ignore[attr-defined]
    assert manager.sentinel_kwargs["password"] == SENTINEL_PASSWORD
    shown = repr(RedisSettings(url="redis://h", password=PASSWORD, sentinel_password="s3cr3t"))
    assert PASSWORD not in shown and "s3cr3t" not in shown


def test_sentinel_passwords_from_files_reach_the_settings(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    captured: list[RedisSettings] = []
    original = kvgate.app.RedisStore.from_settings

    def capture(settings: RedisSettings, **kwargs: Any) -> Any:
        captured.append(settings)
        return original(settings, **kwargs)

    monkeypatch.setattr(kvgate.app.RedisStore, "from_settings", capture)
    master_file, sentinel_file = tmp_path / "master", tmp_path / "sentinel"
    master_file.write_text(PASSWORD + "\n")
    sentinel_file.write_text(SENTINEL_PASSWORD + "\n")
    monkeypatch.setenv("KVGATE_TEST_SENTINEL_PASSWORD", SENTINEL_PASSWORD)
    for sentinel_secret in (
        {"password_file": str(sentinel_file)},
        {"password_env": "KVGATE_TEST_SENTINEL_PASSWORD"},
    ):
        config = config_for(
            "redis://127.0.0.1:1/0",
            password_file=str(master_file),
            sentinel={"master": "main", "nodes": ["127.0.0.1:1"], **sentinel_secret},
        )
        server = KvgateServer(parse_config(config))
        server.tokenizers.close()
        settings = captured.pop()
        assert (settings.password, settings.sentinel_password) == (PASSWORD, SENTINEL_PASSWORD)
    # The inline sentinel password still works, with a warning that names the better fields.
    config = config_for(
        "redis://127.0.0.1:1/0",
        sentinel={"master": "main", "nodes": ["127.0.0.1:1"], "password": SENTINEL_PASSWORD},
    )
    KvgateServer(parse_config(config)).tokenizers.close()
    assert captured.pop().sentinel_password == SENTINEL_PASSWORD
    assert "redis.sentinel.password_file" in caplog.text
    logs = rendered_logs(caplog)
    assert PASSWORD not in logs and SENTINEL_PASSWORD not in logs
