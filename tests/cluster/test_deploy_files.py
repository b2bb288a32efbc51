"""deploy/: compose, Kubernetes and systemd files, checked statically.

Neither Docker nor Kubernetes runs here, so nothing is deployed: the files are parsed and
validated against the Kubernetes OpenAPI schemas (kubernetes-validate, offline), the compose
specification's JSON schema (as vendored by check-jsonschema), `systemd-analyze verify`, and
every `aenv` command line in them is parsed by the real CLI, every AENV_* name looked up in
aenv/config.py. Each check is also shown to refuse a broken file.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import typer.main
import yaml

from aenv.cli.main import app
from aenv.config import Settings

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.30"
SETTINGS = {f"AENV_{name.upper()}" for name in Settings.model_fields}
CLI: Any = typer.main.get_command(app)
# Newer typer carries its own copy of click: its exceptions are that copy's.
CLICK: Any = sys.modules[type(CLI).__mro__[1].__module__.rsplit(".", 1)[0]]
UsageProblem: type[Exception] = CLICK.ClickException


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return out


def k8s_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(name, d) for name, d in k8s_docs() if not d["apiVersion"].startswith("kustomize.config.k8s.io/")]


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # type: ignore[no-any-return]


def compose_schema() -> dict[str, Any]:
    text = files("check_jsonschema").joinpath("builtin_schemas/vendor/compose-spec.json").read_text()
    return json.loads(text)  # type: ignore[no-any-return]


def pod_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    template = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*template.get("initContainers", []), *template.get("containers", [])]


def aenv_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every aenv invocation in deploy/."""
    found: list[tuple[str, list[str]]] = []
    for name, service in compose()["services"].items():
        if str(service.get("image", "")).startswith("aenv:") and service["command"][0] == "aenv":
            found.append((f"compose {name}", [str(a) for a in service["command"]]))
    for file, obj in k8s_objects():
        for c in pod_containers(obj):
            if c["image"].startswith("aenv:"):
                found.append((f"{file} {c['name']}", [*c.get("command", []), *c.get("args", [])]))
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        instance = "8080" if "gateway" in unit.name else "main"
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                found.append((unit.name, shlex.split(line.removeprefix("ExecStart=").replace("%i", instance))))
    return found


def test_every_node_sees_the_shared_volumes_dir_and_the_secrets_key() -> None:
    """A cluster's volumes are one directory every node mounts, and its secrets one key every node
    reads: each node of each deploy form sets both settings to paths its mounts provide."""
    node_pods = [obj for _, obj in k8s_objects() if obj["kind"] == "DaemonSet"]
    assert node_pods
    for obj in node_pods:
        (container,) = [c for c in pod_containers(obj) if c["image"].startswith("aenv:")]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        shared = volumes[mounts[env["AENV_VOLUMES_DIR"]]]
        assert shared["persistentVolumeClaim"]["claimName"] == "aenv-volumes"
        claim = next(d for _, d in k8s_objects() if d["kind"] == "PersistentVolumeClaim")
        assert claim["metadata"]["name"] == "aenv-volumes" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
        key_dir = str(Path(env["AENV_SECRETS_KEY_FILE"]).parent)
        assert "secret" in volumes[mounts[key_dir]]
    nodes = {
        name: svc for name, svc in compose()["services"].items() if "AENV_VOLUMES_DIR" in svc.get("environment", {})
    }
    assert len(nodes) >= 2
    for name, svc in nodes.items():
        mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in svc["volumes"] if isinstance(v, str)}
        env = svc["environment"]
        assert mounts[env["AENV_VOLUMES_DIR"]] == "aenv-volumes", name
        assert mounts[str(Path(env["AENV_SECRETS_KEY_FILE"]).parent)] == "secrets-key", name
    systemd = (DEPLOY / "systemd" / "aenv.env").read_text()
    assert re.search(r"^AENV_VOLUMES_DIR=/\S+", systemd, re.M) and re.search(
        r"^AENV_SECRETS_KEY_FILE=/\S+", systemd, re.M
    )


def parse_cli(argv: list[str]) -> Any:
    """What `aenv` itself would make of ``argv`` (unknown options, bad values: click errors)."""
    assert Path(argv[0]).name == "aenv", argv
    sub = CLI.commands[argv[1]]
    return sub.make_context(argv[1], list(argv[2:]))


# -- Kubernetes ------------------------------------------------------------------------------------


def test_k8s_objects_match_the_openapi_schemas() -> None:
    objects = k8s_objects()
    kinds = sorted(d["kind"] for _, d in objects)
    assert kinds == sorted(
        [
            "Namespace",
            "Secret",
            "Secret",
            "Secret",
            "Secret",
            "Secret",
            "PersistentVolumeClaim",
            "ConfigMap",
            "Job",
            "Service",
            "StatefulSet",
            "DaemonSet",
            "Deployment",
            "Service",
        ]
        + ["Ingress"]
    )
    for file, obj in objects:
        assert obj["metadata"]["name"], file
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "aenv", (file, obj["kind"])
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any schema error


def test_k8s_schema_check_refuses_broken_objects() -> None:
    daemonset = next(d for _, d in k8s_objects() if d["kind"] == "DaemonSet")
    no_selector = json.loads(json.dumps(daemonset))
    del no_selector["spec"]["selector"]
    typo = json.loads(json.dumps(daemonset))
    typo["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {"privileged": True}
    for broken in (no_selector, typo):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_k8s_objects_fit_together() -> None:
    """What the schemas cannot see: selectors match templates, services select pods, the
    kustomization lists files that exist, $(VAR) in args are defined, env comes from objects
    that exist, hostPaths the node needs."""
    objects = k8s_objects()
    names = {(d["kind"], d["metadata"]["name"]) for _, d in objects}
    pod_labels = []
    for _, obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
            pod_labels.append(labels)
            for c in pod_containers(obj):
                defined = {e["name"] for e in c.get("env", [])}
                for ref in re.findall(r"\$\((\w+)\)", " ".join([*c.get("command", []), *c.get("args", [])])):
                    assert ref in defined, f"{c['name']} uses $({ref}) but does not define it"
                for source in c.get("envFrom", []):
                    kind, ref = (
                        ("ConfigMap", source["configMapRef"])
                        if "configMapRef" in source
                        else ("Secret", source["secretRef"])
                    )
                    assert (kind, ref["name"]) in names
    for _, svc in (o for o in objects if o[1]["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pod_labels), svc["metadata"]["name"]
    kustomization = next(d for _, d in k8s_docs() if d["kind"] == "Kustomization")
    assert all((DEPLOY / "k8s" / f).is_file() for f in kustomization["resources"])
    node = next(d for _, d in objects if d["kind"] == "DaemonSet")
    container = node["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["privileged"] is True
    host_paths = {v["hostPath"]["path"] for v in node["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    assert {"/var/lib/aenv", "/usr/bin/runsc"} <= host_paths
    etcd = next(d for _, d in objects if d["kind"] == "StatefulSet")
    headless = next(
        d for _, d in objects if d["kind"] == "Service" and d["metadata"]["name"] == etcd["spec"]["serviceName"]
    )
    assert headless["spec"]["clusterIP"] == "None" and etcd["spec"]["replicas"] == 3


# -- compose ----------------------------------------------------------------------------------------


def test_compose_matches_the_compose_spec() -> None:
    doc = compose()
    jsonschema.validate(doc, compose_schema())
    services = doc["services"]
    assert sum(1 for s in services if s.startswith("etcd") and s[4:].isdigit()) == 3
    assert sum(1 for s in services if s.startswith("gateway")) == 2
    for name, service in services.items():
        deps = service.get("depends_on", [])
        assert set(deps) <= set(services), name
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            assert source.startswith(("/", "$")) or source in doc["volumes"], (name, volume)
    nodes = [s for s in services.values() if s.get("command", [None, None])[1:2] == ["server"]]
    assert len(nodes) == 2 and all(n["privileged"] for n in nodes)
    assert all(n["environment"]["AENV_REPO"].startswith("s3://") for n in nodes)
    assert all(any(v.endswith(":/usr/local/bin/runsc:ro") for v in n["volumes"]) for n in nodes)


def test_compose_schema_check_refuses_broken_files() -> None:
    doc = compose()
    doc["services"]["node0"]["privilidged"] = True
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, compose_schema())


# -- systemd ----------------------------------------------------------------------------------------


def test_systemd_units_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    aenv = shutil.which("aenv")
    assert aenv is not None
    for unit in (DEPLOY / "systemd").glob("*.service"):  # verify wants ExecStart's binary to exist
        (tmp_path / unit.name).write_text(unit.read_text().replace("/usr/local/bin/aenv", str(Path(aenv).resolve())))
    names = ["aenv-node@main.service", "aenv-gateway@8080.service", "aenv-etcd-auth.service"]
    r = subprocess.run(["systemd-analyze", "verify", *names], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    (tmp_path / "aenv-node@.service").write_text(
        (tmp_path / "aenv-node@.service").read_text().replace("KillMode=mixed", "KillMode=gentle")
    )
    bad = subprocess.run(["systemd-analyze", "verify", names[0]], cwd=tmp_path, capture_output=True, text=True)
    assert "kill mode" in bad.stderr  # the check sees a bad directive


# -- what aenv accepts ------------------------------------------------------------------------------


def test_every_aenv_command_line_parses() -> None:
    commands = aenv_commands()
    where = {w.split()[0] for w, _ in commands}
    assert {"compose", "node.yaml", "gateway.yaml", "aenv-node@.service", "aenv-gateway@.service"} <= where
    for place, argv in commands:
        try:
            ctx = parse_cli(argv)
        except UsageProblem as exc:
            pytest.fail(f"{place}: aenv refuses {shlex.join(argv)}: {exc}")
        if argv[1] == "gateway":
            assert ctx.params["host"] == "0.0.0.0" and ctx.params["port"] == 8080
    with pytest.raises(UsageProblem):
        parse_cli(["aenv", "gateway", "--listen", "0.0.0.0"])
    with pytest.raises(UsageProblem):
        parse_cli(["aenv", "server", "--port", "$(PORT)"])


def test_every_aenv_setting_named_exists() -> None:
    texts = {p.relative_to(DEPLOY): p.read_text() for p in DEPLOY.rglob("*") if p.is_file()}
    named = {(str(path), name) for path, text in texts.items() for name in re.findall(r"\bAENV_[A-Z0-9_]+", text)}
    assert named, "the deploy files name no setting"
    unknown = sorted((path, name) for path, name in named if name not in SETTINGS)
    assert unknown == [], f"not settings of aenv/config.py: {unknown}"
    # and what the cluster needs is set everywhere it runs
    for name in ("AENV_CLUSTER", "AENV_API_KEY"):
        assert name in compose()["x-gateway"]["environment"]
        assert name in texts[Path("systemd/aenv.env")]
    configmap = next(d for _, d in k8s_objects() if d["kind"] == "ConfigMap")
    assert configmap["data"]["AENV_CLUSTER"].startswith("etcds://")
    assert "AENV_CLUSTER=etcds://" in texts[Path("systemd/aenv.env")]


def test_k8s_etcd_speaks_tls_with_client_certificates_to_nodes_and_gateways() -> None:
    """etcd holds the cluster's token secret: in k8s its members ask every client and peer for a
    certificate of the CA, and the nodes and gateways have theirs where AENV_CLUSTER_* point."""
    objects = {(d["kind"], d["metadata"]["name"]): d for _, d in k8s_objects()}
    etcd = objects[("StatefulSet", "etcd")]
    args = pod_containers(etcd)[0]["command"]
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    urls = [a.split("=", 1)[1] for a in args if a.split("=", 1)[0].endswith(("-client-urls", "-peer-urls"))]
    assert urls and all(u.startswith("https://") for u in urls), urls
    configmap = objects[("ConfigMap", "aenv")]["data"]
    secret = objects[("Secret", "aenv-etcd-tls")]["stringData"]
    for kind, name in (("DaemonSet", "aenv-node"), ("Deployment", "aenv-gateway")):
        spec = objects[(kind, name)]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounted = {}
        for mount in spec["containers"][0]["volumeMounts"]:
            source = volumes[mount["name"]].get("secret")
            if source and source["secretName"] == "aenv-etcd-tls":
                mounted |= {f"{mount['mountPath']}/{item['path']}": item["key"] for item in source["items"]}
        for setting in ("AENV_CLUSTER_CA", "AENV_CLUSTER_CERT", "AENV_CLUSTER_KEY"):
            assert mounted.get(configmap[setting]) in secret, (name, setting, mounted)
        assert "member.key" not in mounted.values()  # the members' key stays with the members
        # with etcd's auth on, the certificate's common name is the etcd user: each part its own
        role = "node" if kind == "DaemonSet" else "gateway"
        assert mounted[configmap["AENV_CLUSTER_CERT"]] == f"{role}.crt", (name, mounted)
        assert mounted[configmap["AENV_CLUSTER_KEY"]] == f"{role}.key", (name, mounted)
    # and a Job turns etcd's auth on, as root by a password of its own Secret
    job = objects[("Job", "aenv-etcd-auth")]
    container = pod_containers(job)[0]
    argv = [*container["command"], *container["args"]]
    assert argv[:2] == ["aenv", "etcd-auth"], argv
    ctx = parse_cli(argv)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v["secret"] for v in job["spec"]["template"]["spec"]["volumes"]}
    root_file = Path(str(ctx.params["root_password_file"]))
    source = next(v for n, v in volumes.items() if Path(mounts[n]) == root_file.parent)
    assert (source["secretName"], source["items"][0]["key"]) == ("aenv-etcd-root", "password")
    assert "password" in objects[("Secret", "aenv-etcd-root")]["stringData"]


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Where a compose service mounts a part (subpath) of the etcd-tls volume: target -> part."""
    return {
        v["target"]: v.get("volume", {}).get("subpath", "")
        for v in service.get("volumes", [])
        if isinstance(v, dict) and v["source"] == "etcd-tls"
    }


def test_compose_etcd_speaks_tls_with_auth_and_each_part_mounts_its_own_key() -> None:
    """compose ran etcd in plaintext without auth: any container on its network (or a published
    port) read the cluster's token secret. Now as k8s: TLS for clients and peers with client
    certificates, etcd's auth turned on, and each part mounting only its own certificate's key."""
    doc = compose()
    services = doc["services"]
    members = {n: s for n, s in services.items() if n.startswith("etcd") and n[4:].isdigit()}
    assert len(members) == 3
    for name, member in members.items():
        env = {**doc["x-etcd"]["environment"], **member.get("environment", {})}
        assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true", name
        urls = [env["ETCD_LISTEN_CLIENT_URLS"], env["ETCD_LISTEN_PEER_URLS"], *env["ETCD_INITIAL_CLUSTER"].split(",")]
        urls += [a.split("=", 1)[1] for a in member["command"] if a.startswith("--advertise") or "-peer-urls" in a]
        assert all("https://" in u for u in urls), (name, urls)
        assert _mounts(member) == {"/tls": "member"}, name
        assert all(env[k].startswith("/tls/") for k in env if k.endswith("_FILE")), env
    assert services["etcd-tls"]["command"][:3] == ["python3", "-m", "aenv.cluster.pki"]
    assert set(services["etcd-tls"]["command"][4:]) >= set(members)  # the members' names are in their certificate
    auth = services["etcd-auth"]
    ctx = parse_cli(auth["command"])
    assert ctx.params["cluster"].startswith("etcds://") and _mounts(auth) == {"/etc/aenv/etcd": "root"}
    assert Path(str(ctx.params["root_password_file"])).parent == Path("/etc/aenv/etcd")
    parts = {"node0": "node", "node1": "node", "gateway0": "gateway", "gateway1": "gateway"}
    for name, part in parts.items():
        service = services[name]  # anchors and merge keys resolved
        env = service["environment"]
        assert env["AENV_CLUSTER"].startswith("etcds://"), name
        assert _mounts(service) == {"/etc/aenv/etcd": part}, (name, service["volumes"])  # its own key only
        for setting in ("AENV_CLUSTER_CA", "AENV_CLUSTER_CERT", "AENV_CLUSTER_KEY"):
            assert Path(env[setting]).parent == Path("/etc/aenv/etcd"), (name, setting)
        assert service["depends_on"]["etcd-auth"] == {"condition": "service_completed_successfully"}, name


def test_systemd_etcd_speaks_tls_with_auth() -> None:
    """The systemd files ran etcd as Debian's unit configured by hand: now an /etc/default/etcd
    with TLS for clients and peers and client certificates, and a unit that turns etcd's auth on."""
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "systemd" / "etcd.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    for key in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS"):
        assert env[key].startswith("https://"), key
    assert all(u.split("=", 1)[1].startswith("https://") for u in env["ETCD_INITIAL_CLUSTER"].split(","))
    for key in ("ETCD_TRUSTED_CA_FILE", "ETCD_CERT_FILE", "ETCD_KEY_FILE", "ETCD_PEER_TRUSTED_CA_FILE"):
        assert env[key].startswith("/etc/etcd/tls/"), key
    unit = (DEPLOY / "systemd" / "aenv-etcd-auth.service").read_text()
    argv = next(shlex.split(line[len("ExecStart=") :]) for line in unit.splitlines() if line.startswith("ExecStart="))
    ctx = parse_cli(argv)
    assert argv[1] == "etcd-auth" and ctx.params["root_password_file"] is not None
    assert "Type=oneshot" in unit and "EnvironmentFile=/etc/aenv/aenv.env" in unit
