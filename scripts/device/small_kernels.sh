#!/usr/bin/env bash
# What the small kernels between the batch-1 GEMVs cost: the decode step with one kind of them
# skipped (a timing bound only: the outputs are wrong, the weights dummy), each in its own
# process, alternated with the step as served. Variants (SK_LATENCY, default below):
#   <q>            the step as served; q: bf16 (W2's: context 1024) or fp8 (issue 20's: 512)
#   <q>-nonorm     the add + RMSNorm kernels skipped at up to 8 rows (x passed on as the norm)
#   <q>-noattn     decode attention (and its split merge) skipped (q passed on as its output)
#   <q>-norot      rotary + the KV write skipped (a fresh q tensor, no launch)
#   <q>-s<N>       decode attention in N splits of the context at up to 8 rows (1: no merge
#                  kernel); the outputs right, only the launch differs
#   bash scripts/device/small_kernels.sh                            -> $out/latency-<v>.json
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
NONORM='o.rms_norm = lambda x, w, eps, residual=None, _f=o.rms_norm: (x, x if residual is None else residual) if x.shape[0] <= 8 else _f(x, w, eps, residual)'
NOATTN='o.paged_decode_attention = lambda q, *a, _f=o.paged_decode_attention, **kw: q if q.shape[0] <= 8 else _f(q, *a, **kw)'
NOROT='o.rotary_write_kv = lambda p, q, *a, _f=o.rotary_write_kv, **kw: q.new_empty(q.shape) if q.shape[0] <= 8 else _f(p, q, *a, **kw)'
for v in ${SK_LATENCY:-bf16 bf16-nonorm fp8 fp8-nonorm fp8-noattn fp8-norot}; do
  patch="import kernels.ops as o"
  case $v in
    *-nonorm) patch="$patch; $NONORM" ;;
    *-noattn) patch="$patch; $NOATTN" ;;
    *-norot) patch="$patch; $NOROT" ;;
    *-s[0-9]*) patch="$patch; import kernels.triton_decode as d; d.choose_num_splits = lambda b, h, c, dev, e=2, _f=d.choose_num_splits: ${v##*-s} if b <= 8 else _f(b, h, c, dev, e)" ;;
  esac
  if [ "${v%%-*}" = fp8 ]; then
    latency_run "$v" "$patch" --quantization fp8 --batch-sizes 1 --input-len 512 --output-len 32
  else
    latency_run "$v" "$patch" --batch-sizes 1 --input-len 1024 --output-len 24
  fi
done
