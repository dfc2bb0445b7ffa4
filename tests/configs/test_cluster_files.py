"""The cluster definitions in configs/cluster/ are valid without a cloud account or a Kubernetes cluster.

What is checked:
- ray-cluster.yaml (`ray up`): Ray's own JSON schema shipped in the ray package (ray/autoscaler/ray-schema.json,
  every error reported), then Ray's offline config preparation (provider defaults merged, validate_config), as
  `ray up` does before it talks to the cloud. Then what rayspeed needs: token auth on every `ray start`, GPUs on
  the worker type, the pinned Ray version in the image and the setup, the auth token copied to every node, and
  the header's commands naming job files that exist.
- kuberay-rayjob.yaml / kuberay-raycluster.yaml: a JSON schema written here from KubeRay's ray.io/v1 Go types
  (RayJobSpec, RayClusterSpec, HeadGroupSpec, WorkerGroupSpec, AuthOptions; KubeRay 1.5+) with unknown fields
  rejected at those levels, as the CRD's structural schema prunes or rejects them; the pod templates checked
  for what Kubernetes requires (containers with name and image, string-valued rayStartParams, quantities), and
  rayspeed's needs: apiVersion ray.io/v1, the entrypoint `python jobs/train.py --config <existing file>`,
  nvidia.com/gpu requests = limits on every worker, token auth, rayVersion = the pinned Ray, the shared volume
  mounted at the same path in every pod, the MLflow Service that the tracking URI names.
- kuberay-storage-mlflow.yaml and Dockerfile: the objects the Ray manifests refer to exist and agree.
- MLflow authentication everywhere a cluster file starts or reaches the server: `--app-name basic-auth` with
  mlflow[auth] installed, the admin account and session key from a generated file (ray up) or a Secret
  (KubeRay), the driver's MLFLOW_TRACKING_USERNAME/PASSWORD from the same place, no secret value in any file.
Nothing here needs a network, a cloud SDK or kubectl; nothing is vendored.
"""

import inspect
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "configs" / "cluster"


def _ray_version() -> str:
    import ray

    return ray.__version__


def _pinned_ray() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"ray\[default,train\]==([\d.]+)"', text)
    assert m, "pyproject.toml pins ray[default,train]"
    return m.group(1)


def _job_files_in(text: str) -> list[str]:
    found = re.findall(r"python jobs/train\.py --config (\S+\.yaml)", text)
    return [f.strip("'\"") for f in found]


# ---------------------------------------------------------------- ray up


@pytest.fixture(scope="module")
def launcher():
    return yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())


def test_launcher_valid_against_rays_schema(launcher):
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(launcher), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_launcher_prepares_like_ray_up(launcher):
    """`ray up` merges the provider's defaults and validates before it creates anything: the same, offline."""
    import copy

    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(launcher))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_launcher_token_auth_gpus_and_pins(launcher):
    ray_pin = _pinned_ray()
    assert _ray_version() == ray_pin
    head = " ; ".join(launcher["head_start_ray_commands"])
    workers = " ; ".join(launcher["worker_start_ray_commands"])
    assert re.search(r"RAY_AUTH_MODE=token ray start --head\b", head), head
    assert re.search(r"RAY_AUTH_MODE=token ray start --address=\$RAY_HEAD_IP:6379", workers), workers
    assert "mlflow server --host 0.0.0.0" in head  # one MLflow server, on the head, reachable by every node
    assert launcher["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    types = launcher["available_node_types"]
    gpu_types = [t for name, t in types.items() if name != launcher["head_node_type"]]
    assert gpu_types and all(t["resources"].get("GPU", 0) >= 1 for t in gpu_types)
    assert types[launcher["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert launcher["docker"]["image"].startswith(f"rayproject/ray:{ray_pin}-py311")
    assert any(f'"ray[default,train]=={ray_pin}"' in c for c in launcher["setup_commands"])
    assert any("pip install" in c and "-e ." in c for c in launcher["setup_commands"])
    assert any("/mnt/shared" in o for o in launcher["docker"]["run_options"])


def test_launcher_header_commands_name_real_job_files():
    text = (CLUSTER / "ray-cluster.yaml").read_text()
    jobs = _job_files_in(text)
    assert jobs and all((ROOT / j).is_file() for j in jobs), jobs
    assert "ray up configs/cluster/ray-cluster.yaml" in text


# ---------------------------------------------------------------- KubeRay

QUANTITY = {"anyOf": [{"type": "string", "pattern": r"^[0-9.]+([eE][0-9]+|[numkMGTPE]i?|Ki|Mi|Gi|Ti|Pi|Ei)?$"},
                      {"type": "integer", "minimum": 0}, {"type": "number", "minimum": 0}]}
CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "image": {"type": "string", "minLength": 1},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"],
                                             "properties": {"containerPort": {"type": "integer"}}}},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "requests": {"type": "object", "additionalProperties": QUANTITY},
            "limits": {"type": "object", "additionalProperties": QUANTITY},
            "claims": {"type": "array"}}},
        "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}},
    },
}
POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "metadata": {"type": "object"},
        "spec": {"type": "object", "required": ["containers"], "properties": {
            "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
            "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        }},
    },
    "additionalProperties": False,
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}  # rayStartParams: map[string]string
HEAD_GROUP = {
    "type": "object",
    "required": ["template", "rayStartParams"],
    "additionalProperties": False,
    "properties": {"template": POD_TEMPLATE, "rayStartParams": STRING_MAP, "headService": {"type": "object"},
                   "enableIngress": {"type": "boolean"}, "serviceType": {"type": "string"},
                   "labels": STRING_MAP, "resources": STRING_MAP},
}
WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"],
    "additionalProperties": False,
    "properties": {"groupName": {"type": "string", "minLength": 1}, "replicas": {"type": "integer", "minimum": 0},
                   "minReplicas": {"type": "integer", "minimum": 0}, "maxReplicas": {"type": "integer", "minimum": 0},
                   "idleTimeoutSeconds": {"type": "integer"}, "rayStartParams": STRING_MAP, "template": POD_TEMPLATE,
                   "scaleStrategy": {"type": "object"}, "numOfHosts": {"type": "integer", "minimum": 1},
                   "suspend": {"type": "boolean"}, "labels": STRING_MAP, "resources": STRING_MAP},
}
RAYCLUSTER_SPEC = {
    "type": "object",
    "required": ["headGroupSpec"],
    "additionalProperties": False,
    "properties": {
        "headGroupSpec": HEAD_GROUP,
        "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP},
        "rayVersion": {"type": "string"},
        "authOptions": {"type": "object", "additionalProperties": False,
                        "properties": {"mode": {"enum": ["disabled", "token"]}, "secretName": {"type": "string"},
                                       "enableK8sTokenAuth": {"type": "boolean"}}},
        "enableInTreeAutoscaling": {"type": "boolean"}, "autoscalerOptions": {"type": "object"},
        "headServiceAnnotations": STRING_MAP, "gcsFaultToleranceOptions": {"type": "object"},
        "suspend": {"type": "boolean"}, "managedBy": {"type": "string"}, "upgradeStrategy": {"type": "object"},
    },
}
RAYJOB_SPEC = {
    "type": "object",
    "required": ["entrypoint", "rayClusterSpec"],  # rayspeed's choice: KubeRay also allows clusterSelector
    "additionalProperties": False,
    "properties": {
        "entrypoint": {"type": "string", "minLength": 1}, "runtimeEnvYAML": {"type": "string"},
        "rayClusterSpec": RAYCLUSTER_SPEC, "clusterSelector": STRING_MAP, "metadata": STRING_MAP,
        "jobId": {"type": "string"}, "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode",
                                                                 "SidecarMode"]},
        "shutdownAfterJobFinishes": {"type": "boolean"}, "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
        "activeDeadlineSeconds": {"type": "integer", "minimum": 1}, "backoffLimit": {"type": "integer", "minimum": 0},
        "suspend": {"type": "boolean"}, "submitterPodTemplate": POD_TEMPLATE, "submitterConfig": {"type": "object"},
        "entrypointNumCpus": {"type": "number"}, "entrypointNumGpus": {"type": "number"},
        "entrypointResources": {"type": "string"}, "managedBy": {"type": "string"},
        "deletionStrategy": {"type": "object"}, "schedule": {"type": "string"},
    },
}


def _object(kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "ray.io/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}}},
            "spec": spec,
        },
    }


def _validate(doc: dict, schema: dict) -> None:
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def _pods(cluster_spec: dict):
    yield "head", cluster_spec["headGroupSpec"]["template"]["spec"]
    for g in cluster_spec.get("workerGroupSpecs", []):
        yield g["groupName"], g["template"]["spec"]


def _check_cluster_spec(spec: dict) -> None:
    assert spec["rayVersion"] == _pinned_ray()
    assert spec.get("authOptions", {}).get("mode") == "token", "token auth (KubeRay >= 1.5.1 authOptions)"
    workers = spec["workerGroupSpecs"]
    assert workers
    for g in workers:
        assert g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"], g["groupName"]
        for c in g["template"]["spec"]["containers"]:
            req, lim = c["resources"].get("requests", {}), c["resources"].get("limits", {})
            assert int(lim.get("nvidia.com/gpu", 0)) >= 1, f"{g['groupName']}/{c['name']}: no nvidia.com/gpu limit"
            # Kubernetes: an extended resource's request, when given, must equal its limit.
            assert str(req.get("nvidia.com/gpu", lim["nvidia.com/gpu"])) == str(lim["nvidia.com/gpu"])
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus", "0") == "0"
    mounts = set()
    for where, pod in _pods(spec):
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            assert c["image"].split(":")[-1] != "latest", f"{where}: pin the image"
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{where}/{c['name']}: volumeMount {m['name']} has no volume"
            shared = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] == "shared"]
            assert shared, f"{where}/{c['name']}: the shared checkpoint volume is not mounted"
            mounts.update(shared)
    assert mounts == {"/mnt/shared"}, "the shared volume must be at the same path in every pod"


def _env_of_job(doc: dict) -> dict:
    if doc["kind"] == "RayJob":
        return yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["env_vars"]
    head = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in head.get("env", [])}


@pytest.mark.parametrize("fname,kind", [("kuberay-rayjob.yaml", "RayJob"), ("kuberay-raycluster.yaml", "RayCluster")])
def test_kuberay_manifest(fname, kind):
    text = (CLUSTER / fname).read_text()
    doc = yaml.safe_load(text)
    _validate(doc, _object(kind, RAYJOB_SPEC if kind == "RayJob" else RAYCLUSTER_SPEC))
    spec = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
    _check_cluster_spec(spec)
    env = _env_of_job(doc)
    assert env["RAYSPEED_HOME"].startswith("/mnt/shared/"), "checkpoints must be on the shared volume"
    assert re.match(r"^http://rayspeed-mlflow(\.[a-z0-9.-]+)?:5000$", env["MLFLOW_TRACKING_URI"])
    jobs = _job_files_in(doc["spec"]["entrypoint"] if kind == "RayJob" else text)
    assert jobs and all((ROOT / j).is_file() for j in jobs), jobs
    if kind == "RayJob":
        assert shlex.split(doc["spec"]["entrypoint"].split("&&")[-1])[:3] == ["python", "jobs/train.py", "--config"]


def test_storage_and_mlflow_objects_agree_with_the_ray_manifests():
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay-storage-mlflow.yaml").read_text()) if d]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for d in docs:
        assert d["apiVersion"] and re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", d["metadata"]["name"])
    shared = by[("PersistentVolumeClaim", "rayspeed-shared")]
    assert "ReadWriteMany" in shared["spec"]["accessModes"]
    svc = by[("Service", "rayspeed-mlflow")]
    dep = by[("Deployment", "rayspeed-mlflow")]
    assert dep["spec"]["replicas"] == 1  # SQLite: one server
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert any(p["port"] == 5000 for p in svc["spec"]["ports"])
    cmd = " ".join(dep["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "mlflow server" in cmd and "--artifacts-destination=/mnt/shared/" in cmd and "rayspeed-mlflow" in cmd
    claims = {v["persistentVolumeClaim"]["claimName"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert claims <= {n for k, n in by if k == "PersistentVolumeClaim"}
    for fname in ("kuberay-rayjob.yaml", "kuberay-raycluster.yaml"):
        doc = yaml.safe_load((CLUSTER / fname).read_text())
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        for _, pod in _pods(spec):
            for v in pod.get("volumes", []):
                if "persistentVolumeClaim" in v:
                    assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in by


def test_dockerfile_pins_the_same_ray():
    text = (CLUSTER / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert base.startswith(f"rayproject/ray:{_pinned_ray()}-py311"), base
    assert f'"ray[default,train]=={_pinned_ray()}"' in text and "-e /app" in text
    assert "-f configs/cluster/Dockerfile" in (CLUSTER / "kuberay-rayjob.yaml").read_text()


@pytest.mark.parametrize("break_it,expect", [
    (lambda d: d["spec"].update(entrypoints=d["spec"].pop("entrypoint")), "entrypoint"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0}), "string"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replica=3), "replica"),
    (lambda d: d["spec"]["rayClusterSpec"]["authOptions"].update(mode="tokens"), "tokens"),
    (lambda d: d.update(apiVersion="ray.io/v1alpha1"), "ray.io/v1"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop("image"),
     "image"),
])
def test_kuberay_schema_catches_mistakes(break_it, expect):
    """The schema is not vacuous: typical mistakes in a RayJob are reported."""
    doc = yaml.safe_load((CLUSTER / "kuberay-rayjob.yaml").read_text())
    break_it(doc)
    with pytest.raises(AssertionError, match=re.escape(expect)):
        _validate(doc, _object("RayJob", RAYJOB_SPEC))


def test_launcher_schema_catches_mistakes(launcher):
    import copy

    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    bad = copy.deepcopy(launcher)
    bad["available_node_types"]["gpu_h200"]["resources"]["GPU"] = "8"  # must be an integer
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


# ---------------------------------------------------------------- MLflow authentication

AUTH_SECRET = "rayspeed-mlflow-auth"


def _secret_ref(env: list[dict], name: str) -> tuple[str, str] | None:
    for e in env:
        if e["name"] == name:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef") or {}
            assert "value" not in e, f"{name}: a literal value in a manifest"
            return ref.get("name"), ref.get("key")
    return None


def test_mlflow_requires_authentication_everywhere():
    """Ray needs a token, so must MLflow: nobody else on the cluster network may log runs or move `champion`."""
    from _mlflow_auth import MlflowAuthServer  # the tests' real server starts the same way

    mlflow_pin = re.search(r'"mlflow==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f'"mlflow[auth]=={mlflow_pin}"' in (CLUSTER / "Dockerfile").read_text()

    # ray up: the head generates the admin password and session key once, starts the server with them and writes
    # the same account into ~/rayspeed.env for the driver.
    launcher = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    setup = " ; ".join(launcher["head_setup_commands"])
    start = next(c for c in launcher["head_start_ray_commands"] if "mlflow server" in c)
    assert f'pip install -q "mlflow[auth]=={mlflow_pin}"' in setup
    assert "umask 077" in setup and "secrets.token_urlsafe" in setup and "> ~/mlflow/auth.env" in setup
    server_src = inspect.getsource(MlflowAuthServer)  # tests/tracking/test_mlflow_auth.py's server
    assert "--app-name\", \"basic-auth" in server_src
    for var in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert var in setup and var in server_src, var
    assert "MLFLOW_TRACKING_USERNAME=admin" in setup and "MLFLOW_TRACKING_PASSWORD=$(sed" in setup
    assert re.search(r"\. ~/mlflow/auth\.env && set \+a && exec nohup mlflow server .*--app-name basic-auth\b", start)

    # KubeRay: the Deployment's admin and session key, and the head pods' client credentials, from one Secret.
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay-storage-mlflow.yaml").read_text()) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:3] == ["mlflow", "server", "--app-name=basic-auth"]
    assert c["workingDir"] == "/var/lib/mlflow"  # basic_auth.db on the server's own volume
    assert _secret_ref(c["env"], "MLFLOW_AUTH_ADMIN_USERNAME") == (AUTH_SECRET, "username")
    assert _secret_ref(c["env"], "MLFLOW_AUTH_ADMIN_PASSWORD") == (AUTH_SECRET, "password")
    assert _secret_ref(c["env"], "MLFLOW_FLASK_SERVER_SECRET_KEY") == (AUTH_SECRET, "flask-secret-key")
    assert not any(d["kind"] == "Secret" for d in docs), "the Secret is created by hand, never shipped"
    for fname in ("kuberay-rayjob.yaml", "kuberay-raycluster.yaml"):
        doc = yaml.safe_load((CLUSTER / fname).read_text())
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert _secret_ref(head["env"], "MLFLOW_TRACKING_USERNAME") == (AUTH_SECRET, "username"), fname
        assert _secret_ref(head["env"], "MLFLOW_TRACKING_PASSWORD") == (AUTH_SECRET, "password"), fname
    # No file carries a secret value in clear.
    from rayspeed.redact import is_secret_key

    for path in CLUSTER.iterdir():
        for d in yaml.safe_load_all(path.read_text()) if path.suffix == ".yaml" else []:
            for where, env in _all_env(d):
                for e in env:
                    assert not (is_secret_key(e["name"]) and "value" in e), f"{path.name} {where}: {e['name']}"


def _all_env(doc, where=""):
    if isinstance(doc, dict):
        if isinstance(doc.get("env"), list) and "name" in doc:
            yield f"{where}/{doc['name']}", doc["env"]
        for k, v in doc.items():
            yield from _all_env(v, f"{where}/{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _all_env(v, f"{where}/{i}")
