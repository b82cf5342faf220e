#!/usr/bin/env bash
# AOT compiles of the GLM-5 (744B widths) train step at T = 4K ... 202,752 tokens for v5p, from a CPU host
# with libtpu; each writes OUT/s3_t<T>/compile_report.json. Then bench/long_context_compile_table.py makes
# the table / JSON / plot of attention core vs indexer FLOPs against T.
#
# The scan runs 3 of the 78 layers (1 dense + 2 MoE, + MTP) at full widths on v5p:4x4x8 (128 chips,
# expert 2): every point keeps about 4K tokens per chip (3,168 at 202,752), as the stages of
# configs/glm5_744b_long.py do, with context = T / 4096 sequence shards and fsdp taking the rest.
# FULL=1 also compiles the whole 78-layer 200K step on v5p:8x16x16 (configs/glm5_744b_long.py as is). The
# per-T points keep remat "full", with which their committed results were made.
#
#   bash bench/long_context_compile.sh /tmp/lc                 # about 5-9 min of one core per point
#   POINTS="32768 65536" bash bench/long_context_compile.sh /tmp/lc
set -euo pipefail
OUT=${1:?usage: long_context_compile.sh OUT_DIR}
cd "$(dirname "$0")/.."
export ALLOW_MULTIPLE_LIBTPU_LOAD=1
# T -> "context fsdp batch" on 128 chips with expert 2
declare -A MESH=([4096]="1 64 128" [32768]="8 8 16" [65536]="16 4 8" [131072]="32 2 4" [202752]="64 1 2")
mkdir -p "$OUT"
if [[ "${FULL:-0}" == 1 ]]; then
  python train.py --config=configs/glm5_744b_long.py --compile_only --topology=v5p:8x16x16 \
    --workdir="$OUT/full200k" 2>&1 | tail -n 40 > "$OUT/full200k.log"
fi
for T in ${POINTS:-4096 32768 65536 131072 202752}; do
  read -r context fsdp batch <<< "${MESH[$T]:?no mesh for T=$T}"
  python train.py --config=configs/glm5_744b_long.py --compile_only --topology=v5p:4x4x8 \
    --workdir="$OUT/s3_t$T" --set=model.num_hidden_layers=3 --set=model.first_k_dense_replace=1 \
    --set=data.seq_len="$T" --set=data.batch_size="$batch" --set=mesh.context="$context" \
    --set=mesh.fsdp="$fsdp" --set=mesh.expert=2 --set=model.remat_policy=full 2>&1 | tail -n 40 > "$OUT/s3_t$T.log"
done
