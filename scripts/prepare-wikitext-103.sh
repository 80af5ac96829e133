#!/usr/bin/env bash
# Download, GPT-2 BPE-encode and binarise Wikitext-103 as the TNN paper did
# (docs/references.md#published-configurations; Qin et al., ICLR 2023, https://github.com/OpenNLPLab/Tnn):
#   bash scripts/prepare-wikitext-103.sh [dest]          # dest defaults to <repo>/data-bin/wikitext-103
# e.g.
#   DRY_RUN=1 bash scripts/prepare-wikitext-103.sh        # the commands of the steps that would run
# Each step is skipped when its outputs exist; without network access it stops at once and names every file
# to fetch, from where, and where to put it.
# What it does, and its knobs (environment variables: RAW_DIR, WIKITEXT_URL, GPT2_BPE_URL, CONNECT_TIMEOUT,
# WORKERS, FORCE, DRY_RUN, FAIRSEQ_BIN) with their defaults:
#   python -m fairseq_tnn prepare-wikitext-103 --help        (fairseq_tnn/commands/prepare_wikitext.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
hand_over prepare-wikitext-103 "$@"
