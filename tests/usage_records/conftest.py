"""A private PostgreSQL server per test module, a fresh database per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.postgres_harness import PostgresServer


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_dsn(postgres: PostgresServer) -> str:
    """A database of its own for one test."""
    return postgres.create_database()
