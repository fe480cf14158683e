#!/bin/sh
# Launcher test program: prints the torchrun environment contract, its arguments, a line
# on stderr, a line written in two pieces and a last line without a newline.
for var in RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK \
    ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT \
    TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID TORCHELASTIC_ERROR_FILE OMP_NUM_THREADS; do
  eval "value=\${$var-<unset>}"
  echo "$var=$value"
done
for arg in "$@"; do echo "ARG=$arg"; done
echo "to stderr from rank $RANK" >&2
printf 'first half '
sleep 0.05
printf 'second half\n'
printf 'no newline at the end'
