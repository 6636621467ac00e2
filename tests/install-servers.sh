#!/usr/bin/env bash
# Installs the programs the tests start themselves, where they are missing (Debian/Ubuntu):
# redis-server (the Redis tier's real server) and docker-compose (validates deploy/; no Docker
# engine needed). moto's S3 server comes with the dev extra. Called by `make test`.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-servers: please install ${missing[*]} (no apt-get here); tests needing them will fail" >&2
    exit 0
fi
echo "install-servers: installing ${missing[*]} from Debian's packages" >&2
$SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" || {
    echo "install-servers: could not install ${missing[*]}; tests needing them will fail" >&2
    exit 0
}
# The Debian package starts a system instance; the tests start their own on free ports.
($SUDO systemctl stop redis-server 2>/dev/null || $SUDO service redis-server stop 2>/dev/null) || true
