#!/usr/bin/env bash
# Print the path of a promtool binary for the alert rules' tests
# (tests/helm/test_alerts.py) and `make promtool`, building it once into the
# cache from the Go module proxy.
#
#   deploy/get-promtool.sh             # prints e.g. ~/.cache/sluice/bin/promtool-v0.316.0
#   deploy/get-promtool.sh --no-build  # the same, but never builds: exit 3 when not there yet
#
# The tests call it with --no-build, so that `make test` does not spend many
# minutes building promtool: `make promtool` builds it once, and the alert
# rules' tests run from then on (they skip, saying so, until then).
#
# Where promtool comes from, first that applies wins:
#
#   1. $SLUICE_PROMTOOL, when it names an executable (an operator's own);
#   2. the cache: ${SLUICE_CACHE:-~/.cache/sluice}/bin/promtool-<version>;
#   3. with go: `go install -tags remove_all_sd
#      github.com/prometheus/prometheus/cmd/promtool@v0.316.0` (Prometheus
#      3.x's Go module version) from the Go module proxy.  The build tag
#      leaves out Prometheus's service discovery plugins (AWS, Azure, GCE ...,
#      which the rule tests never use), whose SDKs are most of the build; what
#      is left still compiles the rule engine and its dependencies: many
#      minutes on a clean cache on 2 cores, about 1.5 GB of module and build
#      cache.
#
# Exit status: 0 the path is on stdout; 3 no promtool here (no go, or not
# built yet with --no-build; the reason is on stderr, and the tests skip with
# it); anything else: the build failed (it is not hidden: the tests fail with
# its message).
set -euo pipefail

build=1
case "${1:-}" in
    --no-build) build=0 ;;
    "") ;;
    *) echo "usage: deploy/get-promtool.sh [--no-build]" >&2; exit 2 ;;
esac

GO_PROMTOOL_MODULE="github.com/prometheus/prometheus/cmd/promtool"
GO_PROMTOOL_VERSION="v0.316.0"

say() { echo "get-promtool: $*" >&2; }

if [[ -n "${SLUICE_PROMTOOL:-}" ]]; then
    if [[ -x "$SLUICE_PROMTOOL" ]]; then
        echo "$SLUICE_PROMTOOL"
        exit 0
    fi
    say "SLUICE_PROMTOOL=$SLUICE_PROMTOOL is not an executable file"
    exit 2
fi

cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
bin="$cache/bin"
promtool="$bin/promtool-$GO_PROMTOOL_VERSION"

if [[ -x "$promtool" ]]; then
    echo "$promtool"
    exit 0
fi

if [[ $build == 0 ]]; then
    say "promtool $GO_PROMTOOL_VERSION is not built yet ($promtool): \`make promtool\` builds it with go install (many minutes on 2 cores)"
    exit 3
fi

if ! command -v go >/dev/null 2>&1; then
    say "cannot get promtool on $(uname -s)/$(uname -m): go (for go install $GO_PROMTOOL_MODULE@$GO_PROMTOOL_VERSION) is not installed"
    exit 3
fi

mkdir -p "$bin"
work="$(mktemp -d "$bin/.get-promtool.XXXXXX")"
trap 'rm -rf "$work"' EXIT
start=$SECONDS
say "building promtool $GO_PROMTOOL_VERSION with go install (minutes on a clean cache)"
GOBIN="$work" go install -tags remove_all_sd "$GO_PROMTOOL_MODULE@$GO_PROMTOOL_VERSION"
mv -f "$work/promtool" "$promtool"
say "promtool $GO_PROMTOOL_VERSION ready in $((SECONDS - start)) s: $promtool"
echo "$promtool"
