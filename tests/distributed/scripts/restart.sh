#!/bin/sh
# Launcher test program: restart.sh N -- rank 1 exits 5 while TORCHELASTIC_RESTART_COUNT < N.
if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" -lt "$1" ]; then
  echo "rank 1 failing at restart $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"
  exit 5
fi
sleep 0.1
echo "rank $RANK ok at restart $TORCHELASTIC_RESTART_COUNT"
