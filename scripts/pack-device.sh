#!/usr/bin/env bash
# For a helper working in another git worktree: the device tool sends only the main
# checkout, so this stages the current worktree (scripts/stage-device.sh) and copies its files
# (tracked and untracked-not-ignored) plus the staged .device/ into MAIN/.hx-NAME/, a folder the
# main checkout's .git/info/exclude ignores. Run on the device with carry [".hx-NAME"] and a
# command that starts `cd .hx-NAME && ...` (scripts/device-run.sh then finds .device/ there).
#   bash scripts/pack-device.sh NAME [--no-stage]
set -euo pipefail
name=${1:?usage: pack-device.sh NAME [--no-stage]}
cd "$(dirname "$0")/.."
main=$(dirname "$(git rev-parse --path-format=absolute --git-common-dir)")
[ "${2:-}" = --no-stage ] || bash scripts/stage-device.sh >/dev/null
dst=$main/.hx-$name
grep -qx '/.hx-\*/' "$main/.git/info/exclude" 2>/dev/null || echo '/.hx-*/' >> "$main/.git/info/exclude"
rm -rf "$dst" && mkdir -p "$dst"
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$dst" 2>/dev/null || true
cp -r .device "$dst/.device"
du -sh "$dst"
