#!/usr/bin/env bash
# Stops what tests/rgw/start.sh DIR started, by the pid files under DIR
# (radosgw, the OSD, the monitor: SIGTERM, then SIGKILL after 10 s), and
# removes DIR. Safe to run twice, or on a half-started cluster.
set -uo pipefail
DIR=${1:?usage: tests/rgw/stop.sh DIR}
[ -d "$DIR" ] || exit 0
pids=()
for f in "$DIR"/run/client.rgw.lockstep.pid "$DIR"/run/osd.0.pid "$DIR"/run/mon.a.pid; do
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    pids+=("$pid")
  fi
done
for i in $(seq 1 100); do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
  sleep 0.1
done
for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
case "$DIR" in
  /tmp/lockstep-rgw-*|*/rgw-*) rm -rf "$DIR" ;;
  *) echo "rgw: stopped; left $DIR in place (not a directory start.sh made)" >&2 ;;
esac
