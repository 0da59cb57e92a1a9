"""The jobs' Kafka options, Spark packages and command lines, without starting Spark."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from sluice.cli import build_parser
from sluice.core.config import KafkaConnection
from sluice.core.errors import InvalidRequest
from sluice.pipelines.session import kafka_options, parse_conf, spark_packages

PEM_CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PKCS8_KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"
PKCS1_KEY = "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----\n"


def test_plaintext_connection_is_bootstrap_and_protocol_only() -> None:
    """A plain site file gives the Java client its bootstrap and PLAINTEXT, nothing else."""
    options = kafka_options(KafkaConnection(bootstrap_servers="k1:9092, k2:9092"))
    assert options == {"kafka.bootstrap.servers": "k1:9092,k2:9092", "kafka.security.protocol": "PLAINTEXT"}


def test_sasl_ssl_becomes_a_jaas_line_and_pem_stores(tmp_path: Path) -> None:
    """SASL credentials become a JAAS line (quotes escaped); the PEM files librdkafka reads become the
    Java client's PEM trust store and key store."""
    (tmp_path / "ca.pem").write_text(PEM_CERT)
    (tmp_path / "client.pem").write_text(PEM_CERT)
    (tmp_path / "client.key").write_text(PKCS8_KEY)
    connection = KafkaConnection(
        bootstrap_servers="k:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
        sasl_username="sluice", sasl_password='pa"ss\\word', ssl_ca_location=str(tmp_path / "ca.pem"),
        ssl_certificate_location=str(tmp_path / "client.pem"), ssl_key_location=str(tmp_path / "client.key"),
        ssl_key_password="kp")
    options = kafka_options(connection)
    assert options["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert options["kafka.sasl.jaas.config"] == ('org.apache.kafka.common.security.scram.ScramLoginModule required '
                                                 'username="sluice" password="pa\\"ss\\\\word";')
    assert options["kafka.ssl.truststore.type"] == "PEM"
    assert options["kafka.ssl.truststore.location"] == str(tmp_path / "ca.pem")
    assert options["kafka.ssl.keystore.certificate.chain"] == PEM_CERT
    assert options["kafka.ssl.keystore.key"] == PKCS8_KEY
    assert options["kafka.ssl.key.password"] == "kp"
    plain = kafka_options(KafkaConnection(bootstrap_servers="k:9093", security_protocol="SASL_PLAINTEXT",
                                          sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p"))
    assert plain["kafka.sasl.jaas.config"].startswith("org.apache.kafka.common.security.plain.PlainLoginModule")


def test_a_pkcs1_key_is_refused_with_the_conversion(tmp_path: Path) -> None:
    """Java reads PKCS#8 keys only: a PKCS#1 key (fine for librdkafka) is refused, naming the field and the fix."""
    (tmp_path / "client.pem").write_text(PEM_CERT)
    (tmp_path / "client.key").write_text(PKCS1_KEY)
    connection = KafkaConnection(bootstrap_servers="k:9093", security_protocol="SSL",
                                 ssl_certificate_location=str(tmp_path / "client.pem"),
                                 ssl_key_location=str(tmp_path / "client.key"))
    with pytest.raises(InvalidRequest, match="kafka.ssl_key_location: .*PKCS#8.*openssl pkcs8 -topk8"):
        kafka_options(connection)


def test_spark_packages_match_the_installed_pyspark() -> None:
    """The Kafka source and Avro packages Spark fetches are of the installed PySpark's version."""
    version = importlib.metadata.version("pyspark")
    assert spark_packages() == [f"org.apache.spark:spark-sql-kafka-0-10_2.13:{version}",
                                f"org.apache.spark:spark-avro_2.13:{version}"]


def test_conf_pairs_parse_and_a_bad_one_is_named() -> None:
    """--conf KEY=VALUE pairs become settings; one without '=' is refused, shown as given."""
    assert parse_conf(["spark.driver.memory=2g", "a.b=x=y"]) == {"spark.driver.memory": "2g", "a.b": "x=y"}
    with pytest.raises(InvalidRequest, match="--conf: must be KEY=VALUE"):
        parse_conf(["spark.driver.memory"])


@pytest.mark.parametrize("argv", [["pipeline"], ["pipeline", "lake"], ["pipeline", "reconcile"],
                                  ["pipeline", "queue-health"]])
def test_every_pipeline_command_has_help_with_an_example(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice pipeline --help` and each job's --help end with examples of the command."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out and f"sluice {' '.join(argv)}" in out
