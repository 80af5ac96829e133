#!/usr/bin/env bash
# Build the small offline English corpus in data/sample/ (KJV Bible, public domain), byte for byte the
# committed files:
#   bash scripts/make_sample_data.sh
# e.g.
#   PYTHON=.venv/bin/python OUT_DIR=/tmp/sample bash scripts/make_sample_data.sh
# Needs apt-get and dpkg-deb (Debian/Ubuntu), the apt mirror, libreadline8 and the venv of scripts/setup.sh.
# What it does, and its knobs (environment variables: OUT_DIR, KJV_VERSION, TRAIN_BOOKS, VALID_BOOKS,
# TEST_BOOKS, VOCAB_SIZE, FORCE, FAIRSEQ_BIN, PYTHON) with their defaults:
#   python -m fairseq_tnn make-sample-data --help        (fairseq_tnn/commands/make_sample_data.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
hand_over make-sample-data "$@"
