#!/bin/bash
# Launcher test program: trap_signal.sh DIR -- records SIGTERM/SIGINT in DIR/got_R and exits
# 128+N; DIR/ready_R tells the test the trap is set.
dir=$1
trap 'echo TERM > "$dir/got_$RANK"; exit 143' TERM
trap 'echo INT > "$dir/got_$RANK"; exit 130' INT
echo $$ > "$dir/pid_$RANK"
touch "$dir/ready_$RANK"
while true; do sleep 0.05; done
