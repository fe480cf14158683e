#!/bin/bash
# Launcher test program: ignore_term.sh DIR -- rank 0 exits 1 once every rank is up; the
# others ignore SIGTERM (so only SIGKILL after the grace period stops them).
dir=$1
if [ "$RANK" = 0 ]; then
  for _ in $(seq 200); do
    [ "$(ls "$dir" | grep -c '^pid_')" -ge $((WORLD_SIZE - 1)) ] && exit 1
    sleep 0.05
  done
  exit 1
fi
trap '' TERM
echo $$ > "$dir/pid_$RANK"
while true; do sleep 0.05; done
