"""The job secret: made, parsed from what users write, never shown."""

from __future__ import annotations

import pytest

from hora import env as hora_env
from hora.errors import ConfigError
from hora.jobsecret import SECRET_BYTES, JobSecret, SecretError


def test_a_generated_secret_has_256_bits_and_never_shows_in_repr() -> None:
    secret = JobSecret.generate()
    assert len(secret.key) == SECRET_BYTES
    assert secret.hex() not in repr(secret) and secret.hex() not in str(secret)
    assert JobSecret.generate() != secret


def test_a_mac_binds_every_part_and_its_boundaries() -> None:
    secret = JobSecret.generate()
    tag = secret.mac(b"job", b"ab", b"c")
    assert secret.verify(tag, b"job", b"ab", b"c")
    assert not secret.verify(tag, b"job", b"a", b"bc")
    assert not secret.verify(tag, b"job", b"ab", b"d")
    assert not JobSecret.generate().verify(tag, b"job", b"ab", b"c")
    assert secret.derive("store").mac(b"x") != secret.derive("mesh").mac(b"x") != secret.mac(b"x")


def test_hex_text_and_raw_bytes_are_both_accepted_and_short_ones_refused(tmp_path) -> None:
    secret = JobSecret.generate()
    assert JobSecret.from_text(secret.hex() + "\n", "test") == secret
    raw = tmp_path / "raw"
    raw.write_bytes(secret.key)
    assert JobSecret.from_file(str(raw)) == secret
    with pytest.raises(SecretError, match="too short") as e:
        JobSecret.from_text("abcd", "test")
    assert "abcd" not in str(e.value)


def test_env_reads_the_variable_or_the_file_and_names_a_bad_one(tmp_path) -> None:
    secret = JobSecret.generate()
    assert hora_env.job_secret({}) is None
    assert hora_env.job_secret({"HORA_SECRET": secret.hex()}) == secret
    path = tmp_path / "secret"
    path.write_text(secret.hex())
    assert hora_env.job_secret({"HORA_SECRET_FILE": str(path)}) == secret
    with pytest.raises(ConfigError, match="HORA_SECRET_FILE"):
        hora_env.job_secret({"HORA_SECRET_FILE": str(tmp_path / "missing")})
