"""Consistency checks across deploy/ that no schema can see (run by
scripts/validate-manifests.sh, which first validates every manifest against the
Kubernetes schemas). Each failed check prints one line naming the file and what is
wrong; the exit status is 1 if any failed.

Usage: python3 validate_deploy.py DEPLOY_DIR   (PyYAML on the path)
"""

import hashlib
import pathlib
import re
import sys
import tomllib

import yaml

failures = []


def check(ok, where, message):
    if not ok:
        failures.append(f"{where}: {message}")
    return ok


def cpu_cores(quantity):
    """A Kubernetes CPU quantity ("2", "1500m", 2) in cores."""
    text = str(quantity)
    if text.endswith("m"):
        return int(text[:-1]) / 1000
    return float(text)


def load_all(path):
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def main(deploy):
    kube = deploy / "kubernetes"
    manifests = sorted(p for p in kube.glob("*.yaml") if p.name != "kustomization.yaml")

    # The kustomization names exactly the manifests beside it.
    kustomization = yaml.safe_load((kube / "kustomization.yaml").read_text())
    listed = sorted(kustomization.get("resources", []))
    check(listed == [p.name for p in manifests], "kustomization.yaml",
          f"resources {listed} differ from the manifests {[p.name for p in manifests]}")

    objects = {}
    for path in manifests:
        for doc in load_all(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = (path.name, doc)

    def get(kind):
        found = [v for (k, _), v in objects.items() if k == kind]
        check(len(found) == 1, "kustomization.yaml", f"expected one {kind}, found {len(found)}")
        return found[0] if found else (None, None)

    cm_file, configmap = get("ConfigMap")
    dep_file, deployment = get("Deployment")
    svc_file, service = get("Service")
    pdb_file, pdb = get("PodDisruptionBudget")
    hpa_file, hpa = get("HorizontalPodAutoscaler")
    if None in (configmap, deployment, service, pdb, hpa):
        return

    # serve.toml parses and has what the rest is sized from.
    text = configmap["data"].get("serve.toml")
    if not check(text is not None, cm_file, "no serve.toml key"):
        return
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        check(False, cm_file, f"serve.toml does not parse: {e}")
        return
    for key in ("listen", "threads", "models", "plugins"):
        check(key in config, cm_file, f"serve.toml has no `{key}`")
    requests = config.get("requests", {})
    check("shutdown_grace_ms" in requests, cm_file, "serve.toml has no `[requests] shutdown_grace_ms`")
    threads = config.get("threads")
    grace_ms = requests.get("shutdown_grace_ms", 10000)
    check(isinstance(threads, int) and threads > 0, cm_file, "serve.toml: threads must be a positive integer")
    for plugin in config.get("plugins", []):
        name = plugin.get("name", "?")
        check(plugin.get("threads", 1) <= (threads or 0), cm_file,
              f"serve.toml: plugin {name} needs more threads than the host's budget")
        for model in plugin.get("models", []):
            check(model in config.get("models", {}), cm_file,
                  f"serve.toml: plugin {name} names model {model}, which [models] does not register")

    spec = deployment["spec"]["template"]["spec"]
    template_meta = deployment["spec"]["template"]["metadata"]
    containers = {c["name"]: c for c in spec["containers"]}
    if not check("llamabox" in containers, dep_file, "no container named llamabox"):
        return
    main_c = containers["llamabox"]

    # The rollout trigger: the pod template carries serve.toml's hash.
    digest = hashlib.sha256(text.encode()).hexdigest()
    annotated = template_meta.get("annotations", {}).get("llamabox.dev/serve-toml-sha256")
    check(annotated == digest, dep_file,
          f"annotation llamabox.dev/serve-toml-sha256 is {annotated}, serve.toml's sha256 is {digest} "
          "(update the annotation so the change rolls the replicas)")

    # CPU request = threads (and the limit, when set, too).
    resources = main_c.get("resources", {})
    request = resources.get("requests", {}).get("cpu")
    if check(request is not None, dep_file, "llamabox has no CPU request"):
        check(cpu_cores(request) == threads, dep_file,
              f"CPU request {request} != serve.toml threads {threads}")
    limit = resources.get("limits", {}).get("cpu")
    if limit is not None:
        check(cpu_cores(limit) == threads, dep_file, f"CPU limit {limit} != serve.toml threads {threads}")
    check("memory" in resources.get("requests", {}) and "memory" in resources.get("limits", {}),
          dep_file, "llamabox needs a memory request and limit")

    # Grace period > preStop + shutdown_grace.
    pre_stop = main_c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        pre_stop_s = pre_stop["sleep"]["seconds"]
    else:
        command = pre_stop.get("exec", {}).get("command", [])
        pre_stop_s = int(command[-1]) if command and "sleep" in command[0] else 0
    check(pre_stop_s > 0, dep_file, "llamabox has no preStop sleep (endpoints would still route to a draining pod)")
    grace_s = spec.get("terminationGracePeriodSeconds", 30)
    check(grace_s > pre_stop_s + grace_ms / 1000, dep_file,
          f"terminationGracePeriodSeconds {grace_s} must exceed preStop {pre_stop_s} s + shutdown_grace_ms {grace_ms} ms")

    # Probes on the endpoints `llamabox serve` has.
    paths = {probe: main_c.get(probe, {}).get("httpGet", {}).get("path")
             for probe in ("readinessProbe", "livenessProbe", "startupProbe")}
    check(paths["readinessProbe"] == "/readyz", dep_file, "readinessProbe must be GET /readyz")
    check(paths["livenessProbe"] == "/healthz", dep_file, "livenessProbe must be GET /healthz (never /readyz)")

    # The port serve.toml listens on is the container's `http` port.
    port = int(str(config.get("listen", "")).rsplit(":", 1)[-1] or 0)
    ports = {p.get("name"): p["containerPort"] for p in main_c.get("ports", [])}
    check(ports.get("http") == port, dep_file, f"containerPort http {ports.get('http')} != listen port {port}")

    # Hardening.
    pod_sc = spec.get("securityContext", {})
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        where = f"{dep_file} container {c['name']}"
        check(sc.get("readOnlyRootFilesystem") is True, where, "readOnlyRootFilesystem must be true")
        check(sc.get("allowPrivilegeEscalation") is False, where, "allowPrivilegeEscalation must be false")
        check(sc.get("capabilities", {}).get("drop") == ["ALL"], where, "must drop ALL capabilities")
        check(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where, "must run as non-root")

    # Every file serve.toml names lies in a read-only mount (models) or the image
    # (plugins under /opt/llamabox), and the compile cache in a writable one.
    mounts = {m["mountPath"]: m for m in main_c.get("volumeMounts", [])}

    def mount_of(path):
        best = max((m for m in mounts if path.startswith(m.rstrip("/") + "/")), key=len, default=None)
        return mounts.get(best)

    for name, path in config.get("models", {}).items():
        m = mount_of(path)
        check(m is not None and m.get("readOnly") is True, dep_file,
              f"model {name} ({path}) is not on a read-only volume mount")
    for plugin in config.get("plugins", []):
        path = plugin.get("path", "")
        check(path.startswith("/opt/llamabox/plugins/") or (mount_of(path) or {}).get("readOnly") is True,
              dep_file, f"plugin {plugin.get('name')} ({path}) is neither in the image nor on a read-only mount")
    if "compile_cache" in config:
        m = mount_of(config["compile_cache"])
        check(m is not None and not m.get("readOnly"), dep_file,
              f"compile_cache {config['compile_cache']} is not on a writable mount (the root filesystem is read-only)")
    env = {e["name"]: e.get("value") for e in main_c.get("env", [])}
    for var in ("HOME", "XDG_CACHE_HOME"):
        m = mount_of(str(env.get(var, "")) + "/")
        check(m is not None and not m.get("readOnly"), dep_file, f"{var} must point at a writable mount")
    mounted_config = mount_of("/etc/llamabox/serve.toml")
    check(mounted_config is not None and "/etc/llamabox/serve.toml" in main_c.get("args", []), dep_file,
          "llamabox must run `serve --config /etc/llamabox/serve.toml` with the ConfigMap mounted there")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    if mounted_config is not None:
        check(volumes.get(mounted_config["name"], {}).get("configMap", {}).get("name") == configmap["metadata"]["name"],
              dep_file, "the /etc/llamabox mount is not the serve.toml ConfigMap")

    # Service, PDB and HPA point at these pods.
    labels = template_meta.get("labels", {})
    selects = lambda selector: bool(selector) and all(labels.get(k) == v for k, v in selector.items())
    check(selects(deployment["spec"]["selector"]["matchLabels"]), dep_file, "selector does not match the pod labels")
    check(selects(service["spec"]["selector"]), svc_file, "selector does not match the pods")
    check(selects(pdb["spec"]["selector"]["matchLabels"]), pdb_file, "selector does not match the pods")
    check(service["spec"]["ports"][0].get("targetPort") in ("http", port), svc_file, "targetPort is not the http port")
    target = hpa["spec"]["scaleTargetRef"]
    check(target["kind"] == "Deployment" and target["name"] == deployment["metadata"]["name"], hpa_file,
          "scaleTargetRef is not the llamabox Deployment")
    check(hpa["spec"].get("minReplicas", 1) >= 2, hpa_file, "minReplicas below 2 leaves nothing serving during a drain")

    # The Containerfile (no container engine can build it here; see docs/DEPLOY.md).
    containerfile = deploy / "Containerfile"
    if check(containerfile.exists(), "deploy/Containerfile", "missing"):
        check_containerfile(containerfile.read_text(), config)


def check_containerfile(text, config):
    where = "deploy/Containerfile"
    lines = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    stages = [re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", l, re.I) for l in lines if l.upper().startswith("FROM ")]
    check(len(stages) >= 2, where, "must be multi-stage (a builder and a runtime stage)")
    for m in stages:
        image = m.group(1)
        check(":" in image and not image.endswith(":latest"), where, f"base image {image} must be pinned to a tag")
        check("bookworm" in image, where, f"base image {image} is not Debian bookworm")
    final = [l for l in lines[[i for i, l in enumerate(lines) if l.upper().startswith("FROM ")][-1]:]]
    user = [l.split(None, 1)[1] for l in final if l.upper().startswith("USER ")]
    check(bool(user) and re.match(r"^[1-9][0-9]*(:[0-9]+)?$", user[-1]) is not None, where,
          "the runtime stage must end as a numeric non-root USER (runAsNonRoot can check only a number)")
    env = " ".join(l for l in final if l.upper().startswith("ENV "))
    check("HOME=" in env and "XDG_CACHE_HOME=" in env, where, "the runtime stage must set HOME and XDG_CACHE_HOME")
    copies = [l for l in final if l.upper().startswith("COPY ")]
    check(all("--from=" in l for l in copies), where, "the runtime stage copies only from the build stages")
    check(any("llamabox_openai.wasm" in l for l in copies), where, "the runtime stage must hold the openai plugin")
    plugin_dirs = {str(pathlib.PurePosixPath(p["path"]).parent) for p in config.get("plugins", [])}
    for d in plugin_dirs:
        check(any(d in l for l in copies), where, f"no COPY puts plugins into {d}, where serve.toml looks")
    check(any(re.search(r"\bmake\b.*\bbuild\b", l) for l in lines if l.upper().startswith("RUN ")), where,
          "the builder must run `make build`")
    check(any(l.upper().startswith("ENTRYPOINT ") and "llamabox" in l for l in final), where,
          "the runtime stage needs an ENTRYPOINT running llamabox")
    check(not any(re.search(r"\b(ADD)\b\s+https?://", l, re.I) for l in lines), where, "no ADD from URLs")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    if failures:
        sys.exit(1)
    print("deploy/ consistency checks passed")
