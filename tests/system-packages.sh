#!/bin/sh
# Installs the Debian packages the test suite uses as real peers (a real redis-server for the shared
# task store, a real Chromium to open the benchmark's HTML report, haproxy in front of replicas),
# when they are missing. Part of the README's test command, so a fresh machine (and CI's clean
# clone) gets them too.
# podman: tests/deploy builds and runs the image with it (and skips, saying why, when no base image
# can be pulled).
set -eu
packages="redis-server chromium haproxy podman"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
  echo "tests need these Debian packages:$missing (run as root or install them)" >&2; exit 1
fi
echo "installing Debian packages:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
# shellcheck disable=SC2086
$sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
