#!/usr/bin/env bash
# Installs the built wheel into a fresh venv outside the checkout and checks what a user gets:
# the layout tables and the MNIST sample inside the package, a launcher that does not load
# TensorFlow, the console scripts (each --help exits 0, an unknown flag exits 2), and
# dtk-train-mnist training on the bundled sample offline, with no checkout in sight.
# Dependencies come from the CI venv (a .pth file) so nothing is downloaded twice.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
wheel="$(ls "$repo"/dist/dtk_dtensor-*.whl | head -n 1)"
deps="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m venv "$tmp/venv"
echo "$deps" > "$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ci-deps.pth"
"$tmp/venv/bin/pip" install -q --no-deps "$wheel"
cd "$tmp"
export DTK_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=2
"$tmp/venv/bin/python" - <<'PY'
import sys
import dtk, dtk.cluster.launch
assert "tensorflow" not in sys.modules, "import dtk / dtk.cluster.launch loaded TensorFlow"
assert "/site-packages/dtk/" in dtk.__file__, dtk.__file__
from dtk.parallel import layouts
tables = layouts.available_tables()
assert {"data_parallel", "mlp_model_parallel", "cnn_data_parallel"} <= set(tables), tables
print("wheel smoke: tables", tables)
PY
"$tmp/venv/bin/python" -m dtk.cluster.launch --help > /dev/null
"$tmp/venv/bin/dtk-launch" --help > /dev/null
"$tmp/venv/bin/dtk-explain" --model mlp --mesh batch=4,model=2 --layout mlp_model_parallel | tail -n 1
"$tmp/venv/bin/dtk-explain" --model dlrm --mesh batch=8 | tail -n 1
"$tmp/venv/bin/dtk-env" | head -n 3
"$tmp/venv/bin/dtk-train-mnist" --version
# The license the metadata names ships with the wheel.
python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
found = [n for n in names if n.endswith("/LICENSE") or "/licenses/LICENSE" in n]
assert found, [n for n in names if "dist-info" in n]
text = zipfile.ZipFile(sys.argv[1]).read(found[0]).decode()
assert "Apache License" in text and "Version 2.0, January 2004" in text, text[:200]
print("wheel smoke: license", found[0])
PY
for tool in dtk-train-mnist dtk-train-lm dtk-train-recsys dtk-tune-mnist; do
    "$tmp/venv/bin/$tool" --help > /dev/null
    set +e; "$tmp/venv/bin/$tool" --bogus_flag 2> "$tmp/err.txt"; code=$?; set -e
    [ "$code" = 2 ] && grep -q "^error: unknown flag --bogus_flag" "$tmp/err.txt" \
        || { echo "$tool --bogus_flag: exit $code: $(cat "$tmp/err.txt")"; exit 1; }
done
timeout 600 "$tmp/venv/bin/dtk-train-mnist" --mesh batch=8 --epochs 1 \
    --summary_json "$tmp/summary.json" > "$tmp/out.txt" 2>&1 || { cat "$tmp/out.txt"; exit 1; }
grep -q "using the sample bundled with dtk" "$tmp/out.txt"
"$tmp/venv/bin/python" - "$tmp/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["test_examples"] == 1000 and s["train_examples_per_epoch"] == 2000, s
assert s["test_accuracy"] > 0.6, s["test_accuracy"]
print(f"wheel smoke: dtk-train-mnist on the bundled sample, test accuracy {s['test_accuracy']:.4f}")
PY
echo "wheel smoke: ok"
