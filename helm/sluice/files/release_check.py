"""`helm test`: is this Sluice release healthy?  Run by the chart's test pods with the release's image.

Checks, each printed as OK or FAIL with the reason; the exit status is 1 when one fails:

* --ready URL (any number): the URL answers 200 with {"ready": true}, as a
  service's or the status page's /readyz does;
* --status-site FILE: `sluice admin -c FILE status --json` reads the site, and
  every partition of every queue has a primary that reports (its state is
  running, paused or stopped, not "no primary" or "stale report");
  --expect-receiver adds: a gateway receiver process reports itself running.

Example:
  python release_check.py --ready http://sluice-region:7070/readyz --status-site /etc/sluice/site/site.yaml
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

#: The states of a partition whose primary reports (docs/status-json.md, queues[].partitions[].state).
REPORTING = ("running", "paused", "stopped")


def check_ready(url: str, timeout_s: float) -> str | None:
    """None when ``url`` answers 200 with ready true, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}: {exc.read()[:300].decode('utf-8', 'replace')}"
    except (OSError, ValueError) as exc:
        return f"{url}: {exc}"
    if body.get("ready") is not True:
        return f"{url} answered 200 but not ready: {body}"
    return None


def status_problems(document: dict[str, Any], expect_receiver: bool) -> list[str]:
    """What a status document (``sluice admin status --json``) says is wrong with the site."""
    problems = [f"section {name} unreadable: {why}" for name, why in (document.get("section_errors") or {}).items()]
    for queue in document.get("queues") or []:
        for part in queue.get("partitions") or []:
            if part.get("state") not in REPORTING:
                problems.append(f"{queue.get('kind')} {queue.get('id')} partition {part.get('partition')}: "
                                f"{part.get('state')}")
    if expect_receiver and not any(r.get("running") and r.get("state") == "running"
                                   for r in document.get("receivers") or []):
        problems.append("no gateway receiver process reports itself running")
    return problems


def check_status(site_file: str, expect_receiver: bool, timeout_s: float) -> list[str]:
    try:
        done = subprocess.run(["sluice", "admin", "-c", site_file, "status", "--json"], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"sluice admin status: {exc}"]
    if done.returncode != 0:
        return [f"sluice admin status exited {done.returncode}: {done.stderr.strip()[-1000:]}"]
    try:
        document = json.loads(done.stdout)
    except ValueError as exc:
        return [f"sluice admin status --json printed no JSON document: {exc}"]
    return status_problems(document, expect_receiver)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ready", action="append", default=[], metavar="URL", help="a /readyz URL to check")
    parser.add_argument("--status-site", metavar="FILE", help="site file for `sluice admin status --json`")
    parser.add_argument("--expect-receiver", action="store_true", help="a receiver must report itself running")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per check (default 60)")
    args = parser.parse_args(argv)
    failed = 0
    for url in args.ready:
        problem = check_ready(url, args.timeout_s)
        print(f"{'FAIL' if problem else 'OK  '} ready {url}{': ' + problem if problem else ''}")
        failed += problem is not None
    if args.status_site:
        problems = check_status(args.status_site, args.expect_receiver, args.timeout_s)
        for problem in problems:
            print(f"FAIL status: {problem}")
        if not problems:
            print("OK   status: every queue partition has a reporting primary"
                  + ("; a receiver runs" if args.expect_receiver else ""))
        failed += bool(problems)
    if not args.ready and not args.status_site:
        parser.error("nothing to check: give --ready URL or --status-site FILE")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
