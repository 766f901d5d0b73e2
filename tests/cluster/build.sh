#!/usr/bin/env bash
# Builds the pinned binaries of the test control plane from their Go modules:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  (k8s.io/kubernetes)
#   etcd (go.etcd.io/etcd/server/v3), kwok (sigs.k8s.io/kwok), helm (helm.sh/helm/v3)
# Binaries land outside the clone in $KVFLEET_HOME/cluster/bin-<component>-<version>/, so CI and
# later runs reuse them; a component whose folder is complete is not rebuilt (second run: no-op).
# Go is used only here; the project stays Python. Versions live in versions.env.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

KVFLEET_HOME="${KVFLEET_HOME:-$HOME/.cache/kvfleet}"
CLUSTER_HOME="${KVFLEET_CLUSTER_HOME:-$KVFLEET_HOME/cluster}"
export GOMODCACHE="${GOMODCACHE:-$KVFLEET_HOME/go/mod}"
export GOCACHE="${GOCACHE:-$KVFLEET_HOME/go/build}"
export GOPATH="${GOPATH:-$KVFLEET_HOME/go/path}"
export CGO_ENABLED=0
# Never fetch another Go toolchain behind our back: the pinned versions build with Go >= 1.26.
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="-buildvcs=false -mod=mod"

say() { echo "cluster-build: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

bin_dir() { echo "$CLUSTER_HOME/bin-$1-$2"; }

# A folder is complete only when the last step wrote its stamp, so an interrupted build is redone.
is_complete() { [ -f "$(bin_dir "$1" "$2")/.complete" ]; }

all_complete() {
  is_complete kubernetes "$KUBERNETES_VERSION" && is_complete etcd "$ETCD_VERSION" \
    && is_complete kwok "$KWOK_VERSION" && is_complete helm "$HELM_VERSION"
}

find_go() {
  if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
    export PATH="/usr/local/go/bin:$PATH"
  fi
  command -v go >/dev/null 2>&1 \
    || die "no Go toolchain: install Go >= 1.26 (e.g. /usr/local/go/bin/go) to build the test cluster"
  local have
  have="$(go env GOVERSION)"
  case "$have" in
    go1.2[6-9]*|go1.[3-9][0-9]*) ;;
    *) die "Go $have is too old: the pinned etcd/kwok/helm need Go >= 1.26" ;;
  esac
  say "using $(go version)"
}

# new_wrapper DIR: an empty Go module whose only purpose is to require the component.
new_wrapper() {
  rm -rf "$1"; mkdir -p "$1"
  (cd "$1" && go mod init kvfleet.local/cluster-build >/dev/null 2>&1)
}

# finish COMPONENT VERSION STAGING_DIR: move a finished build into place atomically.
finish() {
  local dest; dest="$(bin_dir "$1" "$2")"
  date -u +%FT%TZ > "$3/.complete"
  rm -rf "$dest"; mv "$3" "$dest"
  say "$1 $2 -> $dest"
}

build_kubernetes() {
  local v="$KUBERNETES_VERSION" minor="${KUBERNETES_VERSION#v1.}"
  minor="${minor%%.*}"
  local staging_version="v0.${KUBERNETES_VERSION#v1.}"
  local src="$CLUSTER_HOME/src/kubernetes-$v" out="$CLUSTER_HOME/.staging-kubernetes-$v"
  say "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $v"
  new_wrapper "$src"
  local gomod
  gomod="$(go mod download -json "k8s.io/kubernetes@$v" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  [ -f "$gomod" ] || die "could not download k8s.io/kubernetes@$v from $(go env GOPROXY)"
  {
    echo "require k8s.io/kubernetes $v"
    # k8s.io/kubernetes requires its staging modules as v0.0.0 and points them at ./staging;
    # outside its repository each must be replaced by the published v0.X.Y of the same release.
    sed -n 's#^[[:space:]]*\(k8s.io/[^[:space:]]*\) => ./staging/src/.*#replace \1 => \1 '"$staging_version"'#p' "$gomod"
    grep '^godebug' "$gomod" || true
  } >> "$src/go.mod"
  grep -q '^replace k8s.io/api ' "$src/go.mod" || die "no staging replaces found in $gomod"
  local built
  built="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$(dirname "$gomod")/$v.info")"
  local pkg=k8s.io/component-base/version cg=k8s.io/client-go/pkg/version ldflags="-s -w"
  for p in $pkg $cg; do
    ldflags+=" -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=${built:-unknown}"
  done
  rm -rf "$out"; mkdir -p "$out"
  (cd "$src" && go mod download k8s.io/kubernetes \
    && go build -trimpath -ldflags "$ldflags" -o "$out/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl) \
    || die "go build of Kubernetes $v failed (see above)"
  finish kubernetes "$v" "$out"
}

# compile_one COMPONENT VERSION MODULE PACKAGE BINARY OUT [LDFLAGS]: one binary from a module.
compile_one() {
  local c="$1" v="$2" mod="$3" pkg="$4" bin="$5" out="$6" ldflags="-s -w ${7:-}"
  local src="$CLUSTER_HOME/src/$c-$v"
  say "building $c $v ($pkg)"
  new_wrapper "$src"
  rm -rf "$out"; mkdir -p "$out"
  (cd "$src" && go get "$mod@$v" \
    && go build -trimpath -ldflags "$ldflags" -o "$out/$bin" "$pkg") \
    || die "go build of $c $v failed (see above)"
}

build_etcd() {
  local out="$CLUSTER_HOME/.staging-etcd-$ETCD_VERSION"
  compile_one etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 etcd "$out"
  finish etcd "$ETCD_VERSION" "$out"
}

build_helm() {
  local out="$CLUSTER_HOME/.staging-helm-$HELM_VERSION"
  compile_one helm "$HELM_VERSION" helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm helm "$out" \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  finish helm "$HELM_VERSION" "$out"
}

# kwok refuses to start without Stage objects (the node/pod lifecycle it simulates); ship the
# project's own "fast" stages of the same release next to the binary, as kwokctl does.
build_kwok() {
  local v="$KWOK_VERSION" out="$CLUSTER_HOME/.staging-kwok-$KWOK_VERSION"
  compile_one kwok "$v" sigs.k8s.io/kwok sigs.k8s.io/kwok/cmd/kwok kwok "$out" \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=${v#v}"
  local dir
  dir="$(cd "$CLUSTER_HOME/src/kwok-$v" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  local f first=1
  for f in node/fast/node-initialize pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
    [ -f "$dir/kustomize/stage/$f.yaml" ] || die "kwok $v has no stage $f.yaml in $dir"
    [ $first -eq 1 ] || echo "---"
    first=0
    cat "$dir/kustomize/stage/$f.yaml"
  done > "$out/stages.yaml"
  finish kwok "$v" "$out"
}

# The fixture makes its certificates with the openssl CLI; Debian images usually have it.
ensure_openssl() {
  command -v openssl >/dev/null 2>&1 && return 0
  say "installing openssl (the test cluster's certificates are made with it)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q \
    --no-install-recommends openssl || die "could not install openssl"
}

main() {
  ensure_openssl
  if all_complete; then
    say "binaries up to date in $CLUSTER_HOME"; exit 0
  fi
  mkdir -p "$CLUSTER_HOME"
  # Two checkouts on one machine may run `make test` together: one builds, the other waits.
  exec 9>"$CLUSTER_HOME/.build.lock"
  flock 9
  find_go
  local start=$SECONDS
  is_complete etcd "$ETCD_VERSION" || build_etcd
  is_complete kwok "$KWOK_VERSION" || build_kwok
  is_complete helm "$HELM_VERSION" || build_helm
  is_complete kubernetes "$KUBERNETES_VERSION" || build_kubernetes
  say "done in $((SECONDS - start)) s"
}

main "$@"
