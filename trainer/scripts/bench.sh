#!/usr/bin/env bash
# Reproduces the trainer figures of docs/BENCHMARKS.md (section "Trainer"):
# TCP collective bandwidth against raw loopback TCP, and the checkpoint overhead on
# training throughput (preset small, 2 and 4 ranks, no checkpoints / every 10 steps /
# every step, blocking and overlapped staging), plus the cost of deterministic mode.
#
#   trainer/scripts/bench.sh [SCRATCH_DIR]     (default /tmp/ckpt-train-bench)
#   STEPS=40 REPS=2 trainer/scripts/bench.sh
#   MODES="none 10" COLLECTIVES=0 FAST=0 REPS=3 trainer/scripts/bench.sh   # A/B only
#   NPROCS=4 STAGINGS="blocking overlapped" COLLECTIVES=0 FAST=0 trainer/scripts/bench.sh
#   MODES=none SNAPSHOTS="0 1 5 20" PRESET=medium NPROCS=2 COLLECTIVES=0 FAST=0 \
#       trainer/scripts/bench.sh          # the memory tier's cost (snapshots every N)
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p ckpt-trainer --quiet
BIN=target/release/ckpt-train
DIR=${1:-/tmp/ckpt-train-bench}
STEPS=${STEPS:-40}
REPS=${REPS:-2}
MODES=${MODES:-none 10 1}
COLLECTIVES=${COLLECTIVES:-1}
FAST=${FAST:-1}
NPROCS=${NPROCS:-2 4}
STAGINGS=${STAGINGS:-overlapped blocking}
SNAPSHOTS=${SNAPSHOTS:-0}
PRESET=${PRESET:-small}
echo "load before: $(uptime)"
for n in 2 4; do
  [ "$COLLECTIVES" = 1 ] || break
  "$BIN" launch --nproc "$n" -- bench-collectives --size 67108864 --iters 5 | grep -v '^launch:'
done
for rep in $(seq "$REPS"); do
  for n in $NPROCS; do
    for every in $MODES; do
     for snap in $SNAPSHOTS; do
      for staging in $STAGINGS; do
        rm -rf "$DIR"
        args=(--preset "$PRESET" --steps "$STEPS" --log-every 1000)
        if [ "$every" != none ]; then
          args+=(--ckpt "file://$DIR" --ckpt-every "$every" --staging "$staging")
        elif [ "$snap" != 0 ]; then
          # Snapshots only: the checkpointer's store gets the last step's save.
          args+=(--ckpt "file://$DIR" --ckpt-every 0 --staging "$staging")
        fi
        [ "$snap" = 0 ] || args+=(--snapshot-every "$snap")
        echo "== rep $rep nproc $n preset $PRESET ckpt-every $every snapshot-every $snap staging $staging"
        "$BIN" launch --nproc "$n" -- "${args[@]}" | grep -E 'done:|time per step'
        # Without checkpoints or snapshots the staging mode does not matter: run it once.
        [ "$every" != none ] || [ "$snap" != 0 ] || break
      done
     done
    done
  done
  rm -rf "$DIR"
  [ "$FAST" = 1 ] || continue
  echo "== rep $rep nproc 2 no checkpoints, fast mode (--deterministic=false)"
  "$BIN" launch --nproc 2 -- --preset small --steps "$STEPS" --log-every 1000 --deterministic=false | grep -E 'done:|time per step'
done
rm -rf "$DIR"
echo "load after: $(uptime)"
