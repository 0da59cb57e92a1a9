"""Pin deploy/Dockerfile's base images by digest: ``ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:…``.

A tag moves (each Python patch release, each Debian security update); a
digest names one image for good, so a rebuild gets the same bytes.  For each
``ARG …_IMAGE=`` line this asks Docker Hub's registry API which digest the
tag points to now (the multi-architecture index, so amd64 and arm64 builds
both keep working) and writes ``tag@sha256:<digest>``; run it again to move
the pins forward.  The registry must be reachable: without it the Dockerfile
is left as it is and the command says why, exit 1.

    python deploy/pin_base_images.py            # pin (or re-pin) in place
    python deploy/pin_base_images.py --check    # exit 1 unless every base image is pinned
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parent / "Dockerfile"
_ARG = re.compile(r"^(ARG [A-Z_]+_IMAGE=)([^\s@]+)(@sha256:[0-9a-f]{64})?[ \t]*$", re.MULTILINE)
_INDEX_TYPES = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
])


def hub_digest(image: str, timeout_s: float = 20.0) -> str:
    """The digest Docker Hub's ``image`` ("python:3.11-slim-bookworm") points to now: "sha256:…"."""
    name, _, tag = image.partition(":")
    repository = name if "/" in name else f"library/{name}"
    token_url = f"https://auth.docker.io/token?service=registry.docker.io&scope=repository:{repository}:pull"
    with urllib.request.urlopen(token_url, timeout=timeout_s) as answer:  # noqa: S310 (a fixed https URL)
        token = json.load(answer)["token"]
    request = urllib.request.Request(
        f"https://registry-1.docker.io/v2/{repository}/manifests/{tag or 'latest'}", method="HEAD",
        headers={"Authorization": f"Bearer {token}", "Accept": _INDEX_TYPES})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310
        digest = answer.headers.get("Docker-Content-Digest", "")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ValueError(f"Docker Hub answered no digest for {image} (got {digest!r})")
    return digest


def pinned(text: str, digest_of: Callable[[str], str]) -> str:
    """``text`` (a Dockerfile) with each ``ARG …_IMAGE=tag`` line given ``@<digest_of(tag)>``."""
    return _ARG.sub(lambda m: f"{m[1]}{m[2]}@{digest_of(m[2])}", text)


def unpinned(text: str) -> list[str]:
    """The base images of ``text`` that carry no digest."""
    return [m[2] for m in _ARG.finditer(text) if m[3] is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that every base image is pinned")
    parser.add_argument("--dockerfile", type=Path, default=DOCKERFILE, help="default: %(default)s")
    args = parser.parse_args(argv)
    text = args.dockerfile.read_text(encoding="utf-8")
    if args.check:
        missing = unpinned(text)
        for image in missing:
            print(f"{args.dockerfile}: {image} is not pinned by digest", file=sys.stderr)
        return 1 if missing else 0
    try:
        text = pinned(text, hub_digest)
    except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
        print(f"cannot ask Docker Hub for the digests ({exc}); {args.dockerfile} is unchanged", file=sys.stderr)
        return 1
    args.dockerfile.write_text(text, encoding="utf-8")
    print(f"{args.dockerfile}: " + ", ".join(m[2] + m[3] for m in _ARG.finditer(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
