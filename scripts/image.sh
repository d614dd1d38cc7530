#!/usr/bin/env bash
# `make image`: build the kvflow image on a machine that reaches package registries but no
# container registry. A Debian base comes from Debian packages (mmdebstrap), becomes an image
# with `buildah from scratch`, and is passed to the Dockerfile as BASE_IMAGE. Buildah runs with
# the vfs storage driver and chroot isolation (no overlayfs or user namespaces needed), in a
# store of its own (~/.cache/kvflow/containers, or $KVFLOW_IMAGE_STORE), so it never clashes
# with a podman/buildah setup, and a CI cache of ~/.cache keeps the layers between runs.
#
#   scripts/image.sh build      # tools if missing, base, both targets, OCI archive, sizes
#   scripts/image.sh build kvflow   # only the default target (what tests/image needs)
#   scripts/image.sh push REF   # push localhost/kvflow:dev to REF (docker://... implied)
#   scripts/image.sh buildah ARGS...   # run buildah on kvflow's store (inspect, run, rmi, ...)
#
# Layers are cached in the store: a rebuild after a source change reruns only the last steps, and
# an image whose sources (the build context, hashed into an annotation) did not change is not rebuilt.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

STORE="${KVFLOW_IMAGE_STORE:-${KVFLOW_HOME:-$HOME/.cache/kvflow}/containers}"
IMAGE="${KVFLOW_IMAGE_TAG:-localhost/kvflow:dev}"
ARCHIVE="$root/build/kvflow-image.oci.tar"
SUITE="bookworm"
MIRROR="${KVFLOW_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_PACKAGES="python3,python3-venv,ca-certificates"
# The base image's tag names what it is made of, so a change makes a new one.
BASE="localhost/kvflow-base:${SUITE}-$(printf '%s' "$SUITE $MIRROR $BASE_PACKAGES" | sha256sum | cut -c1-12)"
VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' kvflow/__init__.py)"
REPOSITORY="$(sed -n 's/^IMAGE_REPOSITORY = "\(.*\)"$/\1/p' kvflow/__init__.py)"

export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
bah() { buildah --root "$STORE/storage" --runroot "$STORE/run" --storage-driver vfs "$@"; }

ensure_tools() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  [[ ${#missing[@]} -eq 0 ]] && return
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "make image: needs ${missing[*]} (Debian/Ubuntu: apt-get install -y ${missing[*]}, as root)" >&2
    exit 1
  fi
  echo "make image: installing ${missing[*]} (apt-get)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
}

ensure_base() {
  if bah inspect --type image "$BASE" >/dev/null 2>&1; then return; fi
  echo "make image: building the base image $BASE from Debian $SUITE packages (mmdebstrap)"
  mkdir -p build
  local tar="build/kvflow-base-$SUITE.tar"
  # Docs, man pages and locales are left out: nothing in the image reads them.
  mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" --components=main \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$SUITE" "$tar" "$MIRROR"
  local ctr
  ctr="$(bah from scratch)"
  bah add "$ctr" "$tar" / >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$ctr"
  bah commit --quiet --rm "$ctr" "$BASE" >/dev/null
  rm -f "$tar"
}

# What the build context holds (.dockerignore's allow-list), hashed: the images carry it as an
# annotation, so an unchanged tree needs no build at all.
source_hash() {
  { printf '%s\n' "$BASE" "$VERSION"
    find Dockerfile .dockerignore pyproject.toml README.md kvflow kube_operator router gateway sim sidecar beam -type f \
      -not -path '*/__pycache__/*' -not -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
}

build_target() {  # build_target TARGET TAG...
  local target="$1"; shift
  local stamp; stamp="$(source_hash)"
  if [[ "$(bah inspect --type image --format '{{index .ImageAnnotations "io.kvflow.source"}}' "$1" 2>/dev/null)" == "$stamp" ]]; then
    echo "make image: $1 is up to date"
    return
  fi
  local tags=() secret=()
  for tag in "$@"; do tags+=(--tag "$tag"); done
  # A TLS-intercepting proxy's CA (this machine's bundle) reaches pip as a build secret only.
  local ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
  [[ -s "$ca" ]] && secret=(--secret "id=pip-ca,src=$ca")
  bah bud --quiet --layers --network host --isolation chroot --target "$target" \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "VERSION=$VERSION" \
    --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    --annotation "io.kvflow.source=$stamp" "${secret[@]}" "${tags[@]}" --file Dockerfile . >/dev/null
  bah rmi --prune >/dev/null 2>&1 || true  # layers of older builds (the cache of this one stays)
}

size() { bah images --noheading --format '{{.Size}}' "$1" 2>/dev/null | head -1; }

build() {
  ensure_tools
  ensure_base
  build_target kvflow "$IMAGE" "$REPOSITORY:$VERSION"
  [[ "${1:-all}" == kvflow ]] && return
  build_target kvflow-nixl "${IMAGE}-nixl" "$REPOSITORY:$VERSION-nixl"
  mkdir -p build
  rm -f "$ARCHIVE"
  bah push --quiet "$IMAGE" "oci-archive:$ARCHIVE:$IMAGE" >/dev/null
  echo "make image: $IMAGE $(size "$IMAGE"), ${IMAGE}-nixl $(size "${IMAGE}-nixl")" \
       "(uncompressed); $(du -m "$ARCHIVE" | cut -f1) MB OCI archive at build/kvflow-image.oci.tar"
}

case "${1:-build}" in
  build) build "${2:-all}" ;;
  push)
    [[ $# -eq 2 ]] || { echo "usage: scripts/image.sh push REGISTRY/REPO:TAG" >&2; exit 2; }
    ref="$2"; [[ "$ref" == *://* ]] || ref="docker://$ref"
    bah push "$IMAGE" "$ref"
    # the operator runs simulated P/D pods on the same reference with -nixl appended
    if bah images --noheading "${IMAGE}-nixl" >/dev/null 2>&1; then bah push "${IMAGE}-nixl" "${ref}-nixl"; fi ;;
  buildah) shift; bah "$@" ;;
  base) ensure_tools; ensure_base; echo "$BASE" ;;
  *) echo "usage: scripts/image.sh [build|push REF|buildah ARGS...|base]" >&2; exit 2 ;;
esac
