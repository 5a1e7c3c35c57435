#!/usr/bin/env bash
# Starts a one-node Ceph cluster with a RADOS Gateway on loopback, for the
# RGW test suite: one mon, one OSD (memstore: no disk image), radosgw
# (beast) on a free 127.0.0.1 port, a user and the bucket "lockstep". No
# systemd: every daemon runs under DIR with its pid file there.
#
#   tests/rgw/start.sh [DIR]   # DIR: a fresh directory (default: mktemp)
#
# Prints shell assignments on stdout (also written to DIR/env):
#   LOCKSTEP_RGW_DIR, LOCKSTEP_RGW_ENDPOINT, LOCKSTEP_RGW_BUCKET,
#   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
# Progress goes to stderr. Stop it with tests/rgw/stop.sh DIR. Exit 1 with
# the reason (and the end of the failing daemon's log) if it cannot start.
set -euo pipefail
for tool in ceph-mon ceph-osd radosgw radosgw-admin ceph ceph-authtool monmaptool; do
  command -v "$tool" >/dev/null || { echo "rgw: $tool not found (scripts/install-deps.sh installs Ceph)" >&2; exit 1; }
done
DIR=${1:-$(mktemp -d /tmp/lockstep-rgw-XXXXXX)}
mkdir -p "$DIR"/{run,log,mon,osd,rgw}
DIR=$(cd "$DIR" && pwd)
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
MON_PORT=$(free_port)
RGW_PORT=$(free_port)
FSID=$(cat /proc/sys/kernel/random/uuid)
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
CONF=$DIR/ceph.conf
fail() {
  echo "rgw: $1" >&2
  [ -n "${2:-}" ] && [ -f "$2" ] && tail -n 20 "$2" >&2
  "$(dirname "$0")/stop.sh" "$DIR" >/dev/null 2>&1 || true
  exit 1
}
cat >"$CONF" <<CONF
[global]
fsid = $FSID
mon host = [v1:127.0.0.1:$MON_PORT]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv4 = true
ms bind ipv6 = false
ms bind msgr2 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $DIR/keyring
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
mon data = $DIR/mon/\$id
osd data = $DIR/osd/\$id
osd objectstore = memstore
memstore device bytes = 6442450944
mon data avail warn = 5
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
osd max object name len = 460
osd max object namespace len = 64
[client.rgw.lockstep]
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw data = $DIR/rgw
rgw dns name = 127.0.0.1
rgw gc obj min wait = 5
rgw gc processor period = 5
CONF
C=(-c "$CONF")
echo "rgw: keys and monitor map under $DIR" >&2
ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$DIR/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
ceph-authtool "$DIR/keyring" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap osd 'allow *' --cap mgr 'allow profile osd' >/dev/null
ceph-authtool "$DIR/keyring" --gen-key -n client.rgw.lockstep --cap mon 'allow rw' --cap osd 'allow rwx' --cap mgr 'allow rw' >/dev/null
monmaptool --create --addv a "[v1:127.0.0.1:$MON_PORT]" --fsid "$FSID" "$DIR/monmap" >/dev/null
ceph-mon "${C[@]}" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring" >/dev/null 2>&1 || fail "ceph-mon --mkfs failed" "$DIR/log/mon.a.log"
echo "rgw: starting ceph-mon on 127.0.0.1:$MON_PORT" >&2
ceph-mon "${C[@]}" -i a || fail "ceph-mon did not start" "$DIR/log/mon.a.log"
timeout 30 ceph "${C[@]}" --connect-timeout 25 osd new "$OSD_UUID" 0 >/dev/null || fail "the monitor does not answer" "$DIR/log/mon.a.log"
mkdir -p "$DIR/osd/0"
ceph-osd "${C[@]}" -i 0 --mkfs --osd-uuid "$OSD_UUID" >"$DIR/log/osd-mkfs.out" 2>&1 || fail "ceph-osd --mkfs failed" "$DIR/log/osd-mkfs.out"
echo "rgw: starting ceph-osd (memstore)" >&2
ceph-osd "${C[@]}" -i 0 || fail "ceph-osd did not start" "$DIR/log/osd.0.log"
for i in $(seq 1 120); do
  timeout 10 ceph "${C[@]}" osd dump 2>/dev/null | grep -q '^osd.0 up' && break
  [ "$i" = 120 ] && fail "osd.0 did not come up in 60 s" "$DIR/log/osd.0.log"
  sleep 0.5
done
echo "rgw: starting radosgw on 127.0.0.1:$RGW_PORT" >&2
radosgw "${C[@]}" -n client.rgw.lockstep || fail "radosgw did not start" "$DIR/log/client.rgw.lockstep.log"
for i in $(seq 1 240); do
  curl -s -o /dev/null "http://127.0.0.1:$RGW_PORT/" && break
  [ "$i" = 240 ] && fail "radosgw did not answer in 120 s" "$DIR/log/client.rgw.lockstep.log"
  sleep 0.5
done
ACCESS=LOCKSTEPRGW$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F)
SECRET=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
radosgw-admin "${C[@]}" user create --uid=lockstep --display-name=lockstep --access-key="$ACCESS" \
  --secret-key="$SECRET" >/dev/null 2>"$DIR/log/user-create.err" || fail "radosgw-admin user create failed" "$DIR/log/user-create.err"
ENDPOINT=http://127.0.0.1:$RGW_PORT
# The bucket, through the S3 API itself (RGW creates buckets on request).
for i in $(seq 1 20); do
  AWS_ACCESS_KEY_ID=$ACCESS AWS_SECRET_ACCESS_KEY=$SECRET /usr/bin/python3 - "$ENDPOINT" <<'PY' 2>"$DIR/log/bucket.err" && break
import sys, boto3
from botocore.config import Config
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1",
                  config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
s3.create_bucket(Bucket="lockstep")
PY
  [ "$i" = 20 ] && fail "cannot create the bucket" "$DIR/log/bucket.err"
  sleep 0.5
done
cat >"$DIR/env" <<ENV
LOCKSTEP_RGW_DIR=$DIR
LOCKSTEP_RGW_ENDPOINT=$ENDPOINT
LOCKSTEP_RGW_BUCKET=lockstep
AWS_ACCESS_KEY_ID=$ACCESS
AWS_SECRET_ACCESS_KEY=$SECRET
ENV
echo "rgw: ready at $ENDPOINT (bucket lockstep)" >&2
cat "$DIR/env"
