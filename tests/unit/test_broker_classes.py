"""The broker JVM's class-data archive: used when it is newer than every jar, written by a broker that
dumps its classes at exit, and never both at once.  No JVM runs here."""

from __future__ import annotations

import os
from pathlib import Path

from sluice.broker.jars import class_archive, usable_class_archive
from sluice.broker.kafka import EmbeddedKafka


def jars(tmp_path: Path) -> Path:
    libs = tmp_path / "kafka-4.4.0" / "libs"
    libs.mkdir(parents=True)
    for name in ("kafka_2.13-4.4.0.jar", "kafka-clients-4.4.0.jar"):
        (libs / name).write_bytes(b"PK")
        os.utime(libs / name, (1_000, 1_000))
    return libs


def test_an_archive_is_used_only_while_it_is_newer_than_every_jar(tmp_path: Path) -> None:
    libs = jars(tmp_path)
    archive = class_archive(libs)
    assert archive.parent == libs.parent and archive.suffix == ".jsa"
    assert usable_class_archive(libs) is None  # none written yet
    archive.write_bytes(b"classes")
    os.utime(archive, (2_000, 2_000))
    assert usable_class_archive(libs) == archive
    os.utime(libs / "kafka-clients-4.4.0.jar", (3_000, 3_000))  # a jar replaced after the archive
    assert usable_class_archive(libs) is None


def test_a_broker_maps_the_archive_and_the_writing_broker_dumps_instead(tmp_path: Path) -> None:
    libs = jars(tmp_path)
    broker = EmbeddedKafka("a", data_dir=tmp_path / "data", jars_dir=libs)
    assert not any(arg.startswith("-XX:SharedArchiveFile") for arg in broker._command())
    archive = class_archive(libs)
    archive.write_bytes(b"classes")
    os.utime(archive, (2_000, 2_000))
    command = broker._command()
    assert f"-XX:SharedArchiveFile={archive}" in command
    assert command.index(f"-XX:SharedArchiveFile={archive}") < command.index("-cp")

    broker._archive_to = tmp_path / "partial.jsa"
    command = broker._command()
    assert f"-XX:ArchiveClassesAtExit={broker._archive_to}" in command
    assert not any(arg.startswith("-XX:SharedArchiveFile") for arg in command)
    # The storage tool, run first by the same broker, neither maps nor dumps: the archive is the broker's.
    assert not any(arg.startswith(("-XX:SharedArchiveFile", "-XX:ArchiveClassesAtExit")) for arg in broker._java("128m"))
