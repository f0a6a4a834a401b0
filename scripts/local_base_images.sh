#!/usr/bin/env bash
# Local stand-ins for the stack's public images, for a machine that reaches no image registry but Debian's packages
# and PyPI (as the machines kvstorm is built on): compose.local.yaml points compose.yaml at them.
#
#   scripts/local_base_images.sh     # as root, with debootstrap and a running Docker engine ($DOCKER_HOST)
#
#   kvstorm-local/python:3.11-bookworm  for the Dockerfile's BASE_IMAGE: Debian bookworm's python3.11 in a venv
#                                       first on PATH, so `python` and `pip` are what python:3.11-slim-bookworm has,
#                                       with its headers (the CPU kernels are built against Python.h on first use)
#   kvstorm-local/prometheus:bookworm   for prom/prometheus: Debian's prometheus package as the entry point, its data
#                                       folder owned by its user, wget for compose's healthcheck
#
# A build on this machine reaches PyPI the way the host does, so the python image carries what the host's pip is
# configured with (`pip config`): its certificate bundle (global.cert: with an egress proxy's authority, where there
# is one) and the wheels of its find-links folder (global.find-links: here the CPU build of PyTorch, which PyPI has
# only as a CUDA build). About a minute on 2 cores.
set -euo pipefail
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOTFS_IMAGE=kvstorm-local/bookworm:rootfs
export DOCKER_BUILDKIT=0  # the classic builder: BuildKit would pull its own frontend image from a registry

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,libpython3.11-dev,ca-certificates,wget bookworm \
  "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" || { tail -20 "$work/debootstrap.log"; exit 1; }
# No init runs in a container: package scripts must not try to start their services.
printf '#!/bin/sh\nexit 101\n' >"$work/rootfs/usr/sbin/policy-rc.d"
chmod +x "$work/rootfs/usr/sbin/policy-rc.d"
rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/archives/"*.deb
# An imported image has no environment: Docker's default PATH, which the python image extends.
tar -C "$work/rootfs" -c . | docker import --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$ROOTFS_IMAGE" >/dev/null

# A setting of the host's pip from any of its places (files, environment), as `pip config list` shows them.
pip_setting() { python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | tail -1; }

# Everything pip needs lives in the image's venv; the environment tells pip where.
context="$work/python"
mkdir -p "$context/wheels"
find_links=$(pip_setting find-links)
if [ -d "$find_links" ]; then cp "$find_links"/*.whl "$context/wheels/" 2>/dev/null || true; fi
pip_cert=""
host_cert=$(pip_setting cert)
if [ -f "$host_cert" ]; then
  cp "$host_cert" "$context/ca-bundle.crt"
  pip_cert="PIP_CERT=/venv/ca-bundle.crt"
else
  : >"$context/ca-bundle.crt"  # pip keeps its own bundle
fi
docker build --quiet --network host --tag kvstorm-local/python:3.11-bookworm --file - "$context" <<EOF
FROM $ROOTFS_IMAGE
RUN python3 -m venv /venv
COPY wheels/ /venv/wheels/
COPY ca-bundle.crt /venv/
ENV PATH=/venv/bin:\$PATH PIP_FIND_LINKS=/venv/wheels $pip_cert
CMD ["python"]
EOF

mkdir "$work/empty"
docker build --quiet --network host --tag kvstorm-local/prometheus:bookworm --file - "$work/empty" <<EOF
FROM $ROOTFS_IMAGE
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus"]
EOF

docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' 'kvstorm-local/*'
