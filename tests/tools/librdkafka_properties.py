"""The librdkafka properties table (services/core/librdkafka_properties.py), from the library itself.

librdkafka prints its own CONFIGURATION.md with
``rd_kafka_conf_properties_show(FILE *)``; this reads it from the copy
confluent-kafka loads (the wheel's bundled library, or the system's) and
turns each row into ``name: (scope, type, range)``.
``tests/unit/test_librdkafka_passthrough.py`` compares the checked-in table
with it, so a confluent-kafka upgrade that adds, removes or changes a
property fails until the table is written again::

    .venv/bin/python tests/tools/librdkafka_properties.py --write
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import re
import sys
from pathlib import Path

TABLE = Path(__file__).resolve().parents[2] / "services" / "core" / "librdkafka_properties.py"
_ROW = re.compile(r"^(?P<name>[a-z0-9_.]+)\s+\|\s+(?P<scope>[CP*])\s+\|\s(?P<range>.*?)\s*\|.*\*Type: (?P<type>[^*]+)\*\s*$")


def _library() -> ctypes.CDLL:
    """The librdkafka that confluent_kafka itself has loaded (found in this process's memory map)."""
    import confluent_kafka  # noqa: F401  (loads librdkafka)

    with open("/proc/self/maps", encoding="utf-8") as maps:
        paths = {line.split()[-1] for line in maps if "librdkafka" in line and "/" in line}
    if not paths:
        raise RuntimeError("confluent_kafka is loaded but no librdkafka appears in /proc/self/maps")
    return ctypes.CDLL(sorted(paths)[0])


def configuration_markdown() -> str:
    """librdkafka's CONFIGURATION.md as the loaded library prints it."""
    library = _library()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.fclose.argtypes = [ctypes.c_void_p]
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    library.rd_kafka_conf_properties_show.argtypes = [ctypes.c_void_p]
    library.rd_kafka_conf_properties_show(stream)
    libc.fclose(stream)
    try:
        return ctypes.string_at(buffer, size.value).decode("utf-8")
    finally:
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free(buffer)


def properties() -> dict[str, tuple[str, str, str]]:
    """name -> (scope "*"/"P"/"C", type, range) for every global and topic property."""
    table: dict[str, tuple[str, str, str]] = {}
    for line in configuration_markdown().splitlines():
        row = _ROW.match(line)
        if row is not None:
            table[row["name"]] = (row["scope"], row["type"].strip(), row["range"].strip())
    return table


def render(table: dict[str, tuple[str, str, str]]) -> str:
    import confluent_kafka

    rows = "".join(f"    {name!r}: {value!r},\n" for name, value in sorted(table.items()))
    return (
        '"""Every librdkafka configuration property: name -> (scope, type, range).\n\n'
        "Written by tests/tools/librdkafka_properties.py from the librdkafka that\n"
        f"confluent-kafka {confluent_kafka.__version__} loads (librdkafka {confluent_kafka.libversion()[0]}); "
        "do not edit by hand.\n"
        'Scope is librdkafka\'s C/P column: "*" any client, "P" producers, "C" consumers.\n'
        '"""\n\n'
        "PROPERTIES: dict[str, tuple[str, str, str]] = {\n" + rows + "}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {TABLE.relative_to(TABLE.parents[2])}")
    args = parser.parse_args(argv)
    text = render(properties())
    if args.write:
        TABLE.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
