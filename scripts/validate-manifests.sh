#!/usr/bin/env bash
# Offline checks of deploy/: every Kubernetes manifest against the Kubernetes API schemas
# (kubernetes-validate --strict: unknown fields fail too), the kustomize rendering when a
# kubectl is at hand, then scripts/validate_deploy.py (serve.toml parses, CPU request =
# threads, grace period > preStop + shutdown_grace_ms, probes, mounts, the Containerfile).
# kubernetes-validate (it ships the schemas: no cluster, no network after the install)
# is pinned and installed from PyPI once into $LLAMABOX_CACHE/toolchains by
# scripts/pip-tool.sh. Any failure exits non-zero.
#
# KUBE_VERSION: the oldest Kubernetes the manifests are for. 1.30: the preStop `sleep`
# action (beta and on by default from 1.30) is not in older APIs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
deploy="${1:-$root/deploy}"
kube_version="${KUBE_VERSION:-1.30.0}"
tool="$("$root/scripts/pip-tool.sh" kubernetes-validate 1.37.0)"
validate() {
  PYTHONPATH="$tool" python3 -m kubernetes_validate -k "$kube_version" --strict "$@"
}

# The Kustomization itself is kustomize's, not an API object: validate_deploy.py checks it.
mapfile -t manifests < <(find "$deploy/kubernetes" -name '*.yaml' ! -name kustomization.yaml | sort)
[ ${#manifests[@]} -gt 0 ] || { echo "FAIL no manifests under $deploy/kubernetes" >&2; exit 1; }
echo "== kubernetes-validate --strict -k $kube_version: ${#manifests[@]} manifests"
out="$(validate "${manifests[@]}" 2>&1)" || { echo "$out" >&2; echo "FAIL a manifest does not validate" >&2; exit 1; }
# Any line that is not a pass (a warning about an unknown kind, say) is a failure too.
if grep -v '^INFO .* passed for resource ' <<<"$out" | grep -q .; then
  echo "$out" >&2; echo "FAIL kubernetes-validate did not pass every manifest" >&2; exit 1
fi
echo "$out"

if command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; then
  echo "== kubectl kustomize $deploy/kubernetes"
  rendered="$(mktemp --suffix=.yaml)"
  trap 'rm -f "$rendered"' EXIT
  kubectl kustomize "$deploy/kubernetes" >"$rendered"
  out="$(validate "$rendered" 2>&1)" || { echo "$out" >&2; echo "FAIL the kustomize rendering does not validate" >&2; exit 1; }
  echo "$out" | sed "s|$rendered|kustomize build|"
else
  echo "== no kubectl here: the kustomize rendering is not checked (validate_deploy.py checks its resource list)"
fi

echo "== consistency (validate_deploy.py)"
PYTHONPATH="$tool" python3 "$root/scripts/validate_deploy.py" "$deploy"
