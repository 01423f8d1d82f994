"""The job secret: made, parsed from what users write, never shown."""

from __future__ import annotations

import pytest

from hora.common import env as hora_env
from hora.errors import ConfigError
from hora.protocol.jobsecret import SECRET_BYTES, JobSecret, SecretError


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
    spaced = JobSecret(b"\n " + secret.key[2:-2] + b"\t\n")  # random bytes may start or end like whitespace
    raw.write_bytes(spaced.key)
    assert JobSecret.from_file(str(raw)) == spaced
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


def test_hora_secret_writes_a_file_only_its_owner_reads_and_never_prints_the_secret(tmp_path, capsys) -> None:
    from hora.protocol.jobsecret import main

    path = tmp_path / "job.secret"
    assert main([str(path)]) == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    secret = JobSecret.from_file(str(path))
    out, err = capsys.readouterr()
    assert out == "" and secret.hex() not in err and f"HORA_SECRET_FILE={path}" in err
    assert main([str(path)]) == 2  # an existing file is not replaced by accident
    assert "exists: give another file, or --force" in capsys.readouterr().err
    path.chmod(0o644)
    assert main([str(path), "--force"]) == 0 and JobSecret.from_file(str(path)) != secret
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert main(["-"]) == 0  # for a pipe into kubectl create secret
    assert len(bytes.fromhex(capsys.readouterr().out.strip())) == SECRET_BYTES
