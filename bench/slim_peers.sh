#!/usr/bin/env bash
# Shrinks the peer wheels that ../shared/tools/peer-wheels.sh put in .whl/ so that they travel to the GPU machine
# beside the working tree and .whl2/ in one call (the device tool carries 64 MiB in all; the wheels are ~62 MiB):
# tilelang's wheel (49.5 MB, deflate) becomes its unpacked files as .whl/tilelang-site.tar.xz (~30 MB), and
# z3slim.tgz becomes z3slim.tar.xz. A wheel without a .data folder installs as its files unpacked into the
# target, which is what bench/run_gpu.sh does with every .whl/*-site.tar.xz.
#   bash ../shared/tools/peer-wheels.sh && bash bench/slim_peers.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.whl"
for w in tilelang-*.whl; do
  [ -f "$w" ] || continue
  tmp=$(mktemp -d)
  python3 - "$w" "$tmp/x" <<'PY'  # unpacked with the modes the wheel records, as pip installs it
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = info.external_attr >> 16 & 0o777
        if mode and not info.is_dir():
            os.chmod(path, mode)
PY
  if ls -d "$tmp"/x/*.data >/dev/null 2>&1; then
    echo "$w has a .data folder: kept as a wheel"; rm -rf "$tmp"; continue
  fi
  (cd "$tmp/x" && tar cf - . | xz -T0 -6) > "${w%%-*}-site.tar.xz"
  rm -rf "$tmp" "$w"
done
if [ -f z3slim.tgz ]; then
  gzip -dc z3slim.tgz | xz -T0 -6 > z3slim.tar.xz && rm z3slim.tgz
fi
du -sh .
