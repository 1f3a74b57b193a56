#!/bin/bash
# Regenerates the example reports in this folder from the committed fixtures:
#   bash docs/examples/make-examples.sh   (from the repository root, after `make install`)
set -euo pipefail
cd "$(dirname "$0")/../.."
P=.venv/bin/profclass
for name in comm_4gpu host_1gpu; do
  src=$(ls fixtures/profiles/$name.sqlite.* | head -1)
  $P diagnose "$src" --format html --out docs/examples/$name.html -q
  $P diagnose "$src" --format markdown --out docs/examples/$name.md -q
  $P timeline "$src" --out docs/examples/${name}_timeline.png -q
done
