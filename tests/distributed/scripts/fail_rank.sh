#!/bin/bash
# Launcher test program: fail_rank.sh DIR FAILING_RANK MODE
# Every rank writes its pid (DIR/pid_R) and starts a background sleep (pid in DIR/child_R),
# so the test can check that the teardown left no process behind. The other ranks then
# wait; FAILING_RANK, once all ranks are up, fails as MODE says:
#   exit7 | exit2 (a bad config) | sigkill | json (nested torchelastic error file, exit 3) | flatjson | text
dir=$1 failing=$2 mode=$3
echo $$ > "$dir/pid_$RANK"
sleep 60 &
echo $! > "$dir/child_$RANK"
if [ "$RANK" != "$failing" ]; then
  wait
  exit 0
fi
for _ in $(seq 200); do  # up to 10 s for every rank to start
  [ "$(ls "$dir" | grep -c '^child_')" -ge "$WORLD_SIZE" ] && break
  sleep 0.05
done
echo "rank $RANK failing with $mode"
date +%s.%N > "$dir/failed_at"
case $mode in
  exit7) exit 7 ;;
  exit2) exit 2 ;;
  sigkill) kill -KILL $$ ;;
  json) printf '{"message": {"message": "boom from rank %s", "extraInfo": {"py_callstack": "", "timestamp": "0"}}}\n' "$RANK" > "$TORCHELASTIC_ERROR_FILE"; exit 3 ;;
  flatjson) printf '{"message": "flat boom"}' > "$TORCHELASTIC_ERROR_FILE"; exit 3 ;;
  text) printf 'plain boom\n' > "$TORCHELASTIC_ERROR_FILE"; exit 3 ;;
esac
exit 99
