#!/usr/bin/env bash
# Create the virtualenv and install testflinger-magic with everything the lab and tests need.
# libvirt-python compiles against libvirt's headers; virt-xml-validate (libvirt-clients, which
# calls xmllint) checks generated domain XML. As root, missing Debian packages are installed.
set -euo pipefail
venv=${1:-.venv}
need=()
command -v pkg-config >/dev/null || need+=(pkg-config)
pkg-config --exists libvirt 2>/dev/null || need+=(libvirt-dev)
command -v virt-xml-validate >/dev/null || need+=(libvirt-clients)
command -v xmllint >/dev/null || need+=(libxml2-utils)
command -v gcc >/dev/null || need+=(gcc)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bootstrap: installing Debian packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" python3-venv >/dev/null || apt-get install -y -qq "${need[@]}"
  else
    echo "bootstrap: missing system packages: ${need[*]} (install them, e.g. sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e '.[test]'
