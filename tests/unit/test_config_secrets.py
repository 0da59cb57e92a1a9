"""Secrets come from the site file, a file or an environment variable, and are shown nowhere.

Every secret of a site file (the Kafka passwords, also a sender's remote
ones, the region and subscription services' tokens, the region service's member token, the
site's gateway private key) is set through each of its three sources; each time the value
must reach the code that uses it, and must be absent from `sluice config
check`'s output, from ``repr`` of the configuration and from every
ConfigError.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from sluice.core import configcli, sitekeys
from sluice.core.config import SiteConfig, load_config, parse_config
from sluice.core.errors import ConfigError

# 16+ characters, and the base64 of 32 bytes: also a valid Ed25519 private key.
SECRET = base64.b64encode(b"Xy-SECRET-9f8e7d6c5b4a-0123456789"[:32]).decode()
PEER_PUBLIC_KEY = sitekeys.generate()[1]
VARIABLE = "SLUICE_TEST_SECRET"


def base() -> dict[str, Any]:
    return {
        "site": "site-a",
        "dsid": 1,
        "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
        "regions": [{"name": "orders", "buckets": 8, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True}],
    }


def tls_files(folder: Path) -> dict[str, str]:
    for name in ("ca.pem", "user.crt", "user.key"):
        (folder / name).write_text("-----BEGIN-----\n")
    return {"security_protocol": "SSL", "ssl_ca_location": "ca.pem", "ssl_certificate_location": "user.crt",
            "ssl_key_location": "user.key"}


SASL = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "sluice"}


def kafka_section(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data["kafka"].update(SASL)
    return data["kafka"]


def kafka_tls_section(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data["kafka"].update(tls_files(folder))
    return data["kafka"]


def remote_section(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data["gateway_senders"][0]["remote"] = {"bootstrap_servers": "10.0.0.2:9092", **SASL}
    return data["gateway_senders"][0]["remote"]


def region_service_section(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data["region_service"] = {"member_token": "another-secret-member-token"}
    return data["region_service"]


def member_token_section(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data["region_service"] = {}
    return data["region_service"]


def subscriptions_section(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data["subscriptions"] = {}
    return data["subscriptions"]


def site_section(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data["gateway_public_keys"] = {2: PEER_PUBLIC_KEY}
    return data


#: (secret, where it lives, its field name, how the code that uses it reads it)
SECRETS: list[tuple[str, Callable[[dict[str, Any], Path], dict[str, Any]], str, Callable[[SiteConfig], str]]] = [
    ("kafka.sasl_password", kafka_section, "sasl_password", lambda c: c.kafka.client_settings()["sasl.password"]),
    ("kafka.ssl_key_password", kafka_tls_section, "ssl_key_password",
     lambda c: c.kafka.client_settings()["ssl.key.password"]),
    ("gateway_senders[0].remote.sasl_password", remote_section, "sasl_password",
     lambda c: c.gateway_senders[0].remote.client_settings()["sasl.password"]),  # type: ignore[union-attr]
    ("region_service.token", region_service_section, "token",
     lambda c: c.region_service.token.get_secret_value()),  # type: ignore[union-attr]
    ("region_service.member_token", member_token_section, "member_token",
     lambda c: c.region_service.member_token.get_secret_value()),  # type: ignore[union-attr]
    ("subscriptions.token", subscriptions_section, "token",
     lambda c: c.subscriptions.token.get_secret_value()),  # type: ignore[union-attr]
    ("gateway_private_key", site_section, "gateway_private_key",
     lambda c: c.gateway_private_key.get_secret_value()),  # type: ignore[union-attr]
]
SOURCES = ("value", "file", "env")


def with_secret(source: str, section: dict[str, Any], name: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Set ``name`` in ``section`` through ``source``; return how `config check` names that source."""
    if source == "value":
        section[name] = SECRET
        return "the site file"
    if source == "file":
        (folder / "secret.txt").write_text(SECRET + "\n")
        section[f"{name}_file"] = "secret.txt"
        return f"file {folder / 'secret.txt'}"
    monkeypatch.setenv(VARIABLE, SECRET)
    section[f"{name}_env"] = VARIABLE
    return f"environment variable {VARIABLE}"


def check_output(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = configcli.main(["config", "check", str(path)])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def write(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("secret, section_of, name, read", SECRETS, ids=[s[0] for s in SECRETS])
def test_each_secret_from_each_source_is_used_and_never_shown(
    secret: str, section_of: Any, name: str, read: Callable[[SiteConfig], str], source: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The value reaches its user; config check names its source, not it; repr and errors never hold it."""
    data = base()
    shown_source = with_secret(source, section_of(data, tmp_path), name, tmp_path, monkeypatch)
    path = write(tmp_path, data)

    cfg = load_config(path)
    assert read(cfg) == SECRET
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)
    assert read(cfg.with_overrides({"kafka": {"bootstrap_servers": "10.9.9.9:9092"}})) == SECRET

    status, out = check_output(path, capsys)
    assert status == 0 and SECRET not in out
    assert f"secret {secret}: from {shown_source}" in " ".join(out.split())

    # An invalid file: the error, its problems and config check's table hold no secret.
    data["regions"][0]["buckets"] = 0
    data["kafka"]["session_timeout_ms"] = "6000"
    broken = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_config(broken)
    assert SECRET not in str(caught.value) and SECRET not in repr(caught.value.problems)
    status, out = check_output(broken, capsys)
    assert status == 1 and SECRET not in out and "regions[0].buckets" in out


@pytest.mark.parametrize("source", ("value", "file"))
def test_public_keys_from_the_site_file_or_a_file_are_used(
    source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """gateway_public_keys, a map of dsid → public key, takes a gateway_public_keys_file map beside it."""
    data = base()
    data["receiver"] = {"accepted_dsids": [2]}
    data["gateway_private_key"] = SECRET
    if source == "value":
        data["gateway_public_keys"] = {2: PEER_PUBLIC_KEY}
    else:
        (tmp_path / "site-b.pub").write_text(PEER_PUBLIC_KEY + "\n")
        data["gateway_public_keys_file"] = {2: "site-b.pub"}
    path = write(tmp_path, data)

    cfg = load_config(path)
    assert cfg.gateway_public_keys[2] == PEER_PUBLIC_KEY
    moved = cfg.with_overrides({"kafka": {"bootstrap_servers": "10.9.9.9:9092"}})
    assert moved.gateway_public_keys[2] == PEER_PUBLIC_KEY
    status, out = check_output(path, capsys)
    assert status == 0 and SECRET not in out

    # A signing site verifies every site it takes batches from: a dsid without a key is named.
    data["receiver"]["accepted_dsids"] = [2, 3]
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, data))
    assert "no key for accepted dsid(s) [3]" in str(caught.value)
    assert SECRET not in str(caught.value) and SECRET not in repr(caught.value.problems)


def test_removed_hmac_settings_name_their_replacement(tmp_path: Path) -> None:
    """The HMAC settings of earlier releases are refused with what replaced them; their values stay hidden."""
    data = base()
    data["gateway_signing_key"] = SECRET
    data["receiver"] = {"accepted_dsids": [2], "sender_keys_env": {2: VARIABLE}}
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    problems = {field: reason for field, _, reason in caught.value.problems}
    assert "gateway_private_key" in problems["gateway_signing_key"]
    assert "gateway_public_keys" in problems["receiver.sender_keys_env"]
    assert SECRET not in str(caught.value)


def test_an_unset_or_empty_variable_names_the_field_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing or empty environment variable is a ConfigError naming the field and the variable."""
    monkeypatch.delenv(VARIABLE, raising=False)
    cases = [
        ("kafka", lambda d: d["kafka"].update(SASL, sasl_password_env=VARIABLE), "kafka.sasl_password_env"),
        ("token", lambda d: d.update(region_service={"token_env": VARIABLE}), "region_service.token_env"),
        ("member token", lambda d: d.update(region_service={"member_token_env": VARIABLE}),
         "region_service.member_token_env"),
        ("private key", lambda d: d.update(gateway_private_key_env=VARIABLE, gateway_public_keys={2: PEER_PUBLIC_KEY}),
         "gateway_private_key_env"),
    ]
    for what, change, field in cases:
        data = base()
        change(data)
        with pytest.raises(ConfigError) as caught:
            parse_config(data)
        assert (field, VARIABLE, f"the environment variable {VARIABLE} is not set") in caught.value.problems, what
        monkeypatch.setenv(VARIABLE, "")
        with pytest.raises(ConfigError) as caught:
            parse_config(data)
        assert (field, VARIABLE, f"the environment variable {VARIABLE} is empty") in caught.value.problems, what
        monkeypatch.delenv(VARIABLE)


def test_one_source_per_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sources for one secret are refused, naming both; the secret is not shown."""
    monkeypatch.setenv(VARIABLE, SECRET)
    (tmp_path / "secret.txt").write_text(SECRET)
    data = base()
    data["kafka"].update(SASL, sasl_password=SECRET, sasl_password_env=VARIABLE)
    data["gateway_private_key_file"] = "secret.txt"
    data["gateway_private_key_env"] = VARIABLE
    (tmp_path / "b.pub").write_text(PEER_PUBLIC_KEY)
    data["gateway_public_keys"] = {2: PEER_PUBLIC_KEY}
    data["gateway_public_keys_file"] = {2: "b.pub"}
    with pytest.raises(ConfigError) as caught:
        parse_config(data, base_dir=tmp_path)
    problems = {field: reason for field, _, reason in caught.value.problems}
    assert problems["kafka.sasl_password_env"] == "give sasl_password or sasl_password_env, not both"
    assert problems["gateway_private_key_env"] == "give gateway_private_key_file or gateway_private_key_env, not both"
    assert problems["gateway_public_keys_file[2]"].startswith("dsid 2 already has its key in gateway_public_keys")
    assert SECRET not in str(caught.value)

    data = base()
    data["kafka"].update(SASL, sasl_password=SECRET, sasl_password_file="secret.txt", sasl_password_env=VARIABLE)
    with pytest.raises(ConfigError) as caught:
        parse_config(data, base_dir=tmp_path)
    assert caught.value.problems == [("kafka.sasl_password_env", VARIABLE, "give one of sasl_password, "
                                      "sasl_password_file, sasl_password_env, not several")]


def test_kafka_passwords_are_read_each_time_a_client_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kafka password from a variable is read when client settings are made, and its loss is named then."""
    monkeypatch.setenv(VARIABLE, SECRET)
    data = base()
    data["kafka"].update(SASL, sasl_password_env=VARIABLE)
    cfg = parse_config(data)
    monkeypatch.setenv(VARIABLE, "rotated-password")
    assert cfg.kafka.client_settings()["sasl.password"] == "rotated-password"
    monkeypatch.delenv(VARIABLE)
    with pytest.raises(ConfigError) as caught:
        cfg.kafka.client_settings()
    assert caught.value.problems == [("kafka.sasl_password_env", VARIABLE,
                                      f"the environment variable {VARIABLE} is not set")]


def test_a_malformed_private_key_from_a_variable_is_refused_without_showing_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The private key's rules hold whatever its source; the refusal does not show the key."""
    monkeypatch.setenv(VARIABLE, "tiny-key-not-ed25519")
    data = copy.deepcopy(base())
    data["gateway_private_key_env"] = VARIABLE
    data["gateway_public_keys"] = {2: PEER_PUBLIC_KEY}
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert "gateway_private_key" in str(caught.value) and "tiny-key" not in str(caught.value)


def test_empty_secret_file_and_toml_public_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty secret file is named; TOML's string dsids ("2") work for the key maps too."""
    (tmp_path / "empty").write_text("\n")
    data = base()
    data["region_service"] = {"token_file": "empty"}
    with pytest.raises(ConfigError) as caught:
        parse_config(data, base_dir=tmp_path)
    assert caught.value.problems == [("region_service.token_file", str(tmp_path / "empty"), "the file is empty")]

    (tmp_path / "site.toml").write_text(
        f'site = "site-a"\ndsid = 1\ngateway_private_key = "{SECRET}"\n'
        '[kafka]\nbootstrap_servers = "127.0.0.1:9092"\n[[regions]]\nname = "orders"\n'
        f'[receiver]\naccepted_dsids = [2]\n[gateway_public_keys]\n"2" = "{PEER_PUBLIC_KEY}"\n'
    )
    cfg = load_config(tmp_path / "site.toml")
    assert cfg.gateway_public_keys[2] == PEER_PUBLIC_KEY
