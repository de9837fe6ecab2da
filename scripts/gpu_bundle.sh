#!/usr/bin/env bash
# The GPU bundle: what a CUDA machine with torch, Triton and nvcc but no package index needs to serve
# GRAFT through SGLang 0.5.23 (benchmark/gpu_serve_check.sh runs it there), in .gpubundle/, an
# ignored folder that travels beside the source tree:
#
#   sglang.tar.xz  SGLang 0.5.23's wheel without multimodal_gen/, test/, benchmark/ and its five
#                  compiled extensions (gRPC, the Rust server and tree cache: the Python tree cache
#                  takes over); pure Python, so it imports under any CPython >= 3.11
#   site.tar.xz    requirements/gpu-device-wheels.txt as CPython 3.12 manylinux wheels, installed;
#                  sglang-graft's entry points (a dist-info: SGLang's plugin loader finds GRAFT, the
#                  CPU port and the CUDA profile without sgl-kernel); a sitecustomize.py that starts
#                  that profile in every interpreter (SGLANG_GRAFT_CUDA_STANDIN=1)
#   MANIFEST.txt   what is in it and its sizes
#
#   bash scripts/gpu_bundle.sh                 # build (downloads cached under .cache/gpubundle/), check sizes
#   bash scripts/gpu_bundle.sh --travel        # check sizes, then move the committed drafts aside so the
#                                              # tree travels without them (73 MB; the GPU check builds its models)
#   bash scripts/gpu_bundle.sh --restore       # put the heads back
#
# The payload that travels (tracked and untracked-not-ignored files without the heads, plus
# .gpubundle/) must stay under PAYLOAD_LIMIT_MIB (56). GPU_BUNDLE_DIR overrides the output folder;
# PYTHON the interpreter whose pip downloads (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23
PAYLOAD_LIMIT_MIB=${PAYLOAD_LIMIT_MIB:-56}
OUT=${GPU_BUNDLE_DIR:-.gpubundle}
CACHE=.cache/gpubundle
HEADS_ASIDE=.cache/gpubundle-heads
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
# manylinux tags a CPython 3.12 x86-64 machine with glibc >= 2.35 accepts (pip matches each exactly)
PLATFORMS=(manylinux1_x86_64 manylinux2014_x86_64)
for n in 17 24 27 28 31 34 35; do PLATFORMS+=("manylinux_2_${n}_x86_64"); done

heads() { git ls-files 'benchmark/models/*.safetensors'; }

restore_heads() {
    local moved=0
    while read -r f; do
        if [ -f "$HEADS_ASIDE/$f" ]; then mkdir -p "$(dirname "$f")"; mv "$HEADS_ASIDE/$f" "$f"; moved=$((moved + 1)); fi
    done < <(heads)
    git checkout -- $(heads)  # a head that was not moved aside (deleted by hand) comes back from git
    echo "gpu_bundle: the committed heads are back ($moved moved back)"
}

pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

build() {  # 1-2. .gpubundle/
    mkdir -p "$CACHE" "$OUT"
    STAGE=$(mktemp -d)
    trap 'rm -rf "$STAGE"' EXIT

    # 1. SGLang's wheel, without what serving does not import and without compiled code
    echo "gpu_bundle: [1/3] SGLang $SGLANG_VERSION subset"
    ls "$CACHE"/sglang-"$SGLANG_VERSION"-*.whl >/dev/null 2>&1 \
        || pip_ download -q --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_34_x86_64 \
             -d "$CACHE" "sglang==$SGLANG_VERSION"
    mkdir -p "$STAGE/sglang"
    "$PY" -m zipfile -e "$CACHE"/sglang-"$SGLANG_VERSION"-*.whl "$STAGE/sglang"
    rm -rf "$STAGE/sglang/sglang/multimodal_gen" "$STAGE/sglang/sglang/test" "$STAGE/sglang/sglang/benchmark"
    find "$STAGE/sglang" -name '*.so' -delete
    tar -C "$STAGE/sglang" -cf - . | xz -6 -T0 > "$OUT/sglang.tar.xz"

    # 2. the wheels the machine lacks, installed for CPython 3.12, plus sglang-graft's entry points
    echo "gpu_bundle: [2/3] $(grep -cv '^#' requirements/gpu-device-wheels.txt) wheels for CPython 3.12"
    pip_ download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        "${PLATFORMS[@]/#/--platform=}" -d "$CACHE/wheels" -r requirements/gpu-device-wheels.txt
    pip_ install -q --no-index --find-links "$CACHE/wheels" --no-compile --no-deps --only-binary=:all: \
        --target "$STAGE/site" --python-version 3.12 --implementation cp --abi cp312 "${PLATFORMS[@]/#/--platform=}" \
        -r requirements/gpu-device-wheels.txt
    rm -rf "$STAGE/site/bin"
    "$PY" - "$STAGE/site" <<'EOF'
import pathlib, sys, tomllib

site = pathlib.Path(sys.argv[1])
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
lines = []
for group, points in project["entry-points"].items():
    lines += [f"[{group}]"] + [f"{name} = {target}" for name, target in points.items()] + [""]
(info / "entry_points.txt").write_text("\n".join(lines))
(site / "sitecustomize.py").write_text(
    '"""GPU bundle of sglang-graft: the CUDA profile without sgl-kernel starts in every interpreter\n'
    'when SGLANG_GRAFT_CUDA_STANDIN=1 (sglang_cuda_standin.boot; inert otherwise)."""\n'
    "try:\n    import sglang_cuda_standin.boot  # noqa: F401\nexcept ImportError:  # the source tree is not on the path\n"
    "    pass\n")
EOF
    tar -C "$STAGE/site" -cf - . | xz -6 -T0 > "$OUT/site.tar.xz"
}

payload() {  # 3. what travels: the tree without the committed heads, and the bundle
    echo "gpu_bundle: [3/3] payload"
    for f in sglang.tar.xz site.tar.xz; do
        [ -f "$OUT/$f" ] || { echo "gpu_bundle: $OUT/$f is missing: build the bundle first (bash scripts/gpu_bundle.sh)" >&2; exit 1; }
    done
    tree_bytes=$(git ls-files -z --cached --others --exclude-standard | grep -zv '^benchmark/models/.*\.safetensors$' \
        | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
    bundle_bytes=$(stat -c %s "$OUT/sglang.tar.xz" "$OUT/site.tar.xz" | awk '{ s += $1 } END { print s }')
    total=$((tree_bytes + bundle_bytes))
    {
        echo "sglang-graft GPU bundle (scripts/gpu_bundle.sh), SGLang $SGLANG_VERSION, CPython 3.12 wheels"
        echo "sglang.tar.xz $(stat -c %s "$OUT/sglang.tar.xz") bytes ($(mib "$(stat -c %s "$OUT/sglang.tar.xz")"))"
        echo "site.tar.xz $(stat -c %s "$OUT/site.tar.xz") bytes ($(mib "$(stat -c %s "$OUT/site.tar.xz")"))"
        echo "tree without the heads $tree_bytes bytes ($(mib "$tree_bytes"))"
        echo "payload $total bytes ($(mib "$total")), limit $PAYLOAD_LIMIT_MIB MiB"
        echo "wheels:"
        grep -v '^#' requirements/gpu-device-wheels.txt | sed 's/^/  /'
    } > "$OUT/MANIFEST.txt"
    sed -n 2,5p "$OUT/MANIFEST.txt"
    if [ "$total" -gt $((PAYLOAD_LIMIT_MIB * 1048576)) ]; then
        echo "gpu_bundle: the payload, $(mib "$total"), is over $PAYLOAD_LIMIT_MIB MiB" >&2
        exit 1
    fi
}

travel() {
    while read -r f; do
        [ -f "$f" ] || continue
        mkdir -p "$HEADS_ASIDE/$(dirname "$f")"; mv "$f" "$HEADS_ASIDE/$f"
    done < <(heads)
    echo "gpu_bundle: the committed heads are in $HEADS_ASIDE; bring them back with: bash scripts/gpu_bundle.sh --restore"
}

case "${1:-}" in
    "") build; payload ;;
    --travel) payload; travel ;;
    --restore) restore_heads ;;
    *) echo "gpu_bundle.sh: unknown argument $1 (use --travel or --restore)" >&2; exit 2 ;;
esac
