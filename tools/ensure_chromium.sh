#!/usr/bin/env bash
# Make sure a Chromium is available for the browser test of the built site.
# On Debian/Ubuntu with apt it installs the distribution's package (no network at test time:
# only the install needs the package registry). Elsewhere it only reports.
set -u
for c in chromium chromium-browser google-chrome; do
  if command -v "$c" >/dev/null 2>&1; then exit 0; fi
done
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
      echo "ensure_chromium: not root and no sudo; install chromium yourself to run the browser test"; exit 0
    fi
  fi
  echo "ensure_chromium: installing Debian's chromium with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -qq chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq >/dev/null 2>&1 && $SUDO apt-get install -y -qq chromium >/dev/null 2>&1; } \
    || echo "ensure_chromium: apt-get could not install chromium"
else
  echo "ensure_chromium: no apt-get here; install Chromium to run the browser test (it is skipped otherwise, outside CI)"
fi
exit 0
