"""Chapter 9's deploy files as written: the README's `serve run` command, the KubeRay manifest, the image.

None of them can be run here (no container engine, no Kubernetes, and a Ray cluster belongs in
`make test-slow`), so these tests hold the files to what running them needs: the variables the
package sets before Ray starts in every command and container that starts Ray without it, probes
that each pod answers itself (never through a replica of the application), chapter 7's start-up
allowance and timeouts, an image the repository builds, tagged by version and pulled only when
missing, and no autoscaling bounds that nothing reads.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "ch09_scale_out"
DEPLOY = CHAPTER / "deploy"
DOCKERFILE = CHAPTER / "Dockerfile"
IMAGE = "ghcr.io/serving-from-scratch/serving-from-scratch"  # a name a registry can hold
# Ray's single-machine mode: set by the package on a laptop, and what a cluster's nodes must not have.
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(scope="module")
def package_environment() -> dict[str, str]:
    """Every environment variable importing the chapter's package sets, with its value (in a clean process)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "SFS_RAY_ADDRESS"}
    script = ("import json, os; before = dict(os.environ); import chapters.ch09_scale_out; "
              "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=60, check=True)
    variables = json.loads(done.stdout)
    assert SINGLE_MACHINE in variables and "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" in variables, variables
    return variables


def _version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _objects() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text()))


def _manifest() -> dict:
    return next(item for item in _objects() if item["kind"] == "RayService")


# What an application's args may add on a cluster alone (a laptop is one node).
CLUSTER_ONLY_ARGS = {"max_replicas_per_node"}


def _containers(manifest: dict) -> list[dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    return [*cluster["headGroupSpec"]["template"]["spec"]["containers"],
            *(c for group in cluster["workerGroupSpecs"] for c in group["template"]["spec"]["containers"])]


def _shell_commands(text: str) -> list[str]:
    """Logical command lines of ``text`` (backslash continuations joined)."""
    return [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines() if line.strip()]


def _serve_run_commands(text: str) -> list[dict[str, str]]:
    """For each `serve run` command in ``text``: the variables it sets in front of itself."""
    found = []
    for line in _shell_commands(text):
        if "serve run " not in line:
            continue
        words = shlex.split(line)
        variables = {}
        for word in words[:words.index("serve")]:
            name, _, value = word.partition("=")
            if re.fullmatch(r"[A-Z_][A-Z0-9_]*", name) and _:
                variables[name] = value
        found.append(variables)
    return found


def _readme_code_blocks() -> str:
    readme = (CHAPTER / "README.md").read_text()
    return "\n".join(re.findall(r"```(?:bash|sh|console)?\n(.*?)```", readme, flags=re.S))


def test_every_serve_run_command_carries_what_the_package_sets_before_ray_starts(package_environment) -> None:
    """`serve run` starts Ray before it imports the application: the package cannot set them in time."""
    config_header = "\n".join(line.removeprefix("#").removeprefix(" ")
                              for line in (DEPLOY / "serve_config.yaml").read_text().splitlines() if line.startswith("#"))
    for where, text in (("README.md", _readme_code_blocks()), ("serve_config.yaml", config_header)):
        commands = _serve_run_commands(text)
        assert commands, f"{where} gives no `serve run` command in a code block"
        for variables in commands:
            missing = {k: v for k, v in package_environment.items() if variables.get(k) != v}
            assert not missing, f"a `serve run` command in {where} lacks {missing}"


def test_the_manifest_deploys_the_same_application_with_what_the_package_sets_but_single_machine_mode(package_environment) -> None:
    import ray
    from ray.serve.schema import ServeDeploySchema

    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    served = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    local = ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    def same_app(application) -> dict:
        dumped = application.model_dump()
        return {**dumped, "args": {k: v for k, v in dumped["args"].items() if k not in CLUSTER_ONLY_ARGS}}

    assert [same_app(a) for a in served.applications] == [same_app(a) for a in local.applications]
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__  # the image's Ray is the one the code was checked with
    cluster_environment = {k: v for k, v in package_environment.items() if k != SINGLE_MACHINE}
    for container in _containers(manifest):
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        assert SINGLE_MACHINE not in env, "a cluster's nodes must reach each other: not Ray's single-machine mode"
        missing = {k: v for k, v in cluster_environment.items() if env.get(k) != v}
        assert not missing, (container["name"], missing)
    drain_s = max(float(a.args.get("drain_timeout_s", 30)) for a in served.applications)
    for group in cluster["workerGroupSpecs"]:
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s  # the pod outlives its replicas' drain


def _chapter_7_probes() -> dict[str, dict]:
    documents = yaml.safe_load_all((ROOT / "chapters" / "ch07_production" / "deploy" / "k8s.yaml").read_text())
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}


def test_the_workers_probes_are_answered_by_the_pod_itself_with_chapter_7s_allowance_and_timeouts() -> None:
    """Never a replica through the proxy: with every replica down, /readyz through the proxy hangs past any timeout."""
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
    from ray.serve._private.proxy_request_response import ASGIProxyRequest
    from ray.serve.schema import ServeDeploySchema

    manifest = _manifest()
    serve_port = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"])).http_options.port
    chapter_7 = _chapter_7_probes()
    chapter_7_timeout_s = max(probe.get("timeoutSeconds", 1) for probe in chapter_7.values())  # its HTTP probes' timeout
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        container = group["template"]["spec"]["containers"][0]
        for kind in chapter_7:
            probe = container.get(kind)
            assert probe is not None, f"{container['name']} has no {kind}"
            get = probe["httpGet"]
            if get["port"] == serve_port:  # the pod's Serve proxy: only a path the proxy answers itself
                proxy_request = ASGIProxyRequest({"type": "http", "path": get["path"], "root_path": ""}, None, None)
                assert proxy_request.is_health_request or proxy_request.is_route_request, (kind, get)
            else:  # Ray's agent on the pod (KubeRay's own checks)
                assert get["port"] == DEFAULT_DASHBOARD_AGENT_LISTEN_PORT and get["path"].startswith("/api/local_raylet_healthz"), (kind, get)
            assert probe.get("timeoutSeconds", 1) == chapter_7_timeout_s, (kind, probe)  # not Kubernetes' default 1 s
        assert container["readinessProbe"]["httpGet"]["port"] == serve_port  # ready means its proxy can route
        allowance = lambda p: p["periodSeconds"] * p["failureThreshold"]  # noqa: E731
        assert allowance(container["startupProbe"]) >= allowance(chapter_7["startupProbe"])


def test_the_manifest_runs_the_image_the_repository_builds_tagged_by_version_pulled_only_if_missing() -> None:
    tag = f"{IMAGE}:{_version()}"
    for container in _containers(_manifest()):
        assert container["image"] == tag, (container["name"], container["image"])  # never :latest (pull always)
        assert container.get("imagePullPolicy") == "IfNotPresent", container["name"]
    build = f"docker build -f {DOCKERFILE.relative_to(ROOT)} -t {tag} ."
    assert build in DOCKERFILE.read_text()
    made = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert build in made  # `make image` builds that tag (after checking that a container engine exists)
    assert "make image" in (CHAPTER / "README.md").read_text()


def test_the_dockerfile_sets_up_the_repository_as_make_setup_does() -> None:
    dockerfile = DOCKERFILE.read_text()
    makefile = (ROOT / "Makefile").read_text()
    instructions = [line for line in re.sub(r"\\\n", " ", dockerfile).splitlines() if line and not line.startswith("#")]
    setup_target = re.search(r"^setup:\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert "scripts/setup_venv.sh" in setup_target  # `make setup` is this script (and a browser for one test)
    runs = [line for line in instructions if line.startswith("RUN ")]
    setup = next(line for line in runs if "scripts/setup_venv.sh" in line)
    assert ".venv" in setup and setup.split()[-1] == "scale"  # a runtime: chapter 9's extras, no dev, bench or notebooks
    # the same torch as `make setup`, its CPU build (PyPI's Linux build carries CUDA), unless a build asks for another
    makes_torch = re.search(r"^TORCH_SPEC \?= (.+)$", makefile, flags=re.M).group(1).strip()
    assert f'ARG TORCH_SPEC="{makes_torch} --index-url https://download.pytorch.org/whl/cpu"' in instructions
    assert any(line.startswith("RUN apt-get") and " gcc " in line for line in instructions)  # the decode kernel's compiler
    from packaging.specifiers import SpecifierSet

    python = re.match(r"FROM python:(\d+\.\d+)", instructions[0])
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert python and python[1] in SpecifierSet(requires), (instructions[0], requires)  # an interpreter the project supports
    # the whole repository is the context (setup installs it editable), less what setup and runs make
    assert "COPY . ." in instructions and "WORKDIR /app" in instructions
    assert any(line.startswith("ENV PATH=/app/.venv/bin:") for line in instructions)  # `ray start` is the venv's
    ignored = (CHAPTER / "Dockerfile.dockerignore").read_text().splitlines()
    assert {".venv", ".git", "benchmarks/results"} <= set(ignored)


def test_the_worker_group_has_no_autoscaling_bounds_that_nothing_reads() -> None:
    cluster = _manifest()["spec"]["rayClusterConfig"]
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    for group in cluster["workerGroupSpecs"]:
        bounds = {"minReplicas", "maxReplicas"} & set(group)
        if autoscaling:
            assert bounds == {"minReplicas", "maxReplicas"} and group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        else:
            assert not bounds, f"{group['groupName']}: {sorted(bounds)} do nothing without enableInTreeAutoscaling"


def test_every_pod_drains_before_it_stops_within_its_grace_period() -> None:
    """The head's preStop drains the application (stopping.py) for the application's drain_timeout_s; a worker's
    follows a drain the head starts; each pod's grace period outlasts its preStop, so Kubernetes never kills it mid-drain."""
    manifest = _manifest()
    drain_timeout_s = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]["drain_timeout_s"]
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [("head", cluster["headGroupSpec"]["template"]["spec"]),
            *(("worker", group["template"]["spec"]) for group in cluster["workerGroupSpecs"])]
    for role, pod in pods:
        command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        # it joins the pod's cluster: SFS_RAY_ADDRESS keeps the package from choosing Ray's single-machine mode
        assert command[:2] == ["env", "SFS_RAY_ADDRESS=auto"], command
        command = command[2:]
        assert command[:3] == ["python", "-m", "chapters.ch09_scale_out.stopping"], command
        flags = dict(zip(command[3::2], command[4::2], strict=True))
        assert float(flags["--timeout-s"]) == drain_timeout_s, (role, flags)
        follow_s = float(flags.get("--follow-s", 0))
        assert (follow_s > 0) == (role == "worker"), (role, flags)  # only the head starts a drain of the whole application
        from chapters.ch09_scale_out.stopping import EXIT_MARGIN_S

        bound_s = float(flags["--connect-timeout-s"]) + follow_s + drain_timeout_s + EXIT_MARGIN_S  # the command's whole run, at most
        assert pod["terminationGracePeriodSeconds"] > bound_s, (role, pod["terminationGracePeriodSeconds"])


# KubeRay's rules for a RayService's head (ray-operator/controllers/ray/utils/constant.go and the RayService
# controller): the head Service takes the ports the head container declares (its defaults only when it
# declares none), and the controller reaches the dashboard by the port named "dashboard" to submit
# serveConfigV2, and Serve by the port named "serve"; with either missing the application never deploys.
KUBERAY_HEAD_PORTS = {"gcs": 6379, "dashboard": 8265, "serve": 8000}


def test_the_head_declares_every_port_kuberay_looks_up_by_name() -> None:
    from ray.serve.schema import ServeDeploySchema

    manifest = _manifest()
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in head["ports"]}
    assert ports.items() >= KUBERAY_HEAD_PORTS.items(), ports
    serve_port = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"])).http_options.port
    assert ports["serve"] == serve_port  # the Serve Service forwards to what the proxies listen on
    assert "dashboard-port" not in manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]  # Ray's default, 8265


def test_every_pod_template_and_object_is_valid_kubernetes() -> None:
    import kubernetes_validate

    cluster = _manifest()["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], *(group["template"] for group in cluster["workerGroupSpecs"])]
    for template in templates:  # each pod template is a Pod's spec too: Kubernetes' own schema checks it as one
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "template", **template.get("metadata", {})}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, "1.30", strict=True)
    for item in _objects():
        if item["kind"] != "RayService":
            kubernetes_validate.validate(item, "1.30", strict=True)


def test_replicas_are_spread_one_per_pod_with_a_budget_that_keeps_the_loads_need() -> None:
    manifest = _manifest()
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    needed, spare = args["num_replicas"], args["spare_replicas"]
    assert spare >= 1 and args["max_replicas_per_node"] == 1  # the spare never shares a pod with a replica it covers
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["replicas"] >= needed + spare  # a pod for each, or some stay pending
    labels = group["template"]["metadata"]["labels"]
    (spread,) = group["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["labelSelector"]["matchLabels"].items() <= labels.items()
    (budget,) = [item for item in _objects() if item["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["minAvailable"] == needed  # a voluntary disruption may take the spare's share, never the load's


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_every_ray_pod_has_a_dev_shm_that_holds_its_object_store() -> None:
    cluster = _manifest()["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        shm = volumes[mount["name"]]["emptyDir"]
        assert shm["medium"] == "Memory"  # a container's own /dev/shm is 64 MiB; Ray's object store lives there
        assert int(group["rayStartParams"]["object-store-memory"]) <= _bytes(shm["sizeLimit"])  # else Ray falls back to /tmp
        limits = spec["containers"][0]["resources"]["limits"]
        assert _bytes(shm["sizeLimit"]) < _bytes(limits["memory"])  # tmpfs pages count against the pod's memory


# KubeRay's RayService CRD (v1), as tests/schemas/README.md says where it came from.
KUBERAY_SCHEMA = ROOT / "tests" / "schemas" / "kuberay-1.7.0-rayservice-v1.json.gz"


def _strict(schema: dict) -> dict:
    """``schema`` as the API server's strict field validation (kubectl's default) applies it: an object refuses
    fields its schema does not name, except where the schema says ``x-kubernetes-preserve-unknown-fields``."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {name: _strict(child) for name, child in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    for keyword in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(keyword), dict):
            schema[keyword] = _strict(schema[keyword])
    for keyword in ("allOf", "anyOf", "oneOf"):
        if keyword in schema:
            schema[keyword] = [_strict(child) for child in schema[keyword]]
    return schema


def _defaulted(document: object, schema: dict) -> object:
    """``document`` with the schema's defaults filled in where a field is absent, as the API server fills them
    before it validates (so a required field with a default may be left out)."""
    if isinstance(document, dict) and "properties" in schema:
        filled = {name: json.loads(json.dumps(child["default"])) for name, child in schema["properties"].items()
                  if name not in document and "default" in child}
        return {**filled, **{name: _defaulted(value, schema["properties"].get(name, {})) for name, value in document.items()}}
    if isinstance(document, list) and isinstance(schema.get("items"), dict):
        return [_defaulted(item, schema["items"]) for item in document]
    return document


def _crd_errors(document: dict) -> list[str]:
    import gzip

    import jsonschema

    schema = json.loads(gzip.decompress(KUBERAY_SCHEMA.read_bytes()))
    validator = jsonschema.Draft7Validator(_strict(schema))
    errors = validator.iter_errors(_defaulted(document, schema))
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in errors]


def test_the_rayservice_is_valid_against_kuberays_crd_schema() -> None:
    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert _crd_errors(manifest) == []
    misspelled = json.loads(json.dumps(manifest))
    misspelled["spec"]["serveConfigv2"] = misspelled["spec"].pop("serveConfigV2")
    misspelled["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # a string map
    assert len(_crd_errors(misspelled)) == 2  # the check refuses what the API server would


def _make_image(tmp_path: Path, engine: str) -> subprocess.CompletedProcess:
    alone = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}}  # as if typed, under make test too
    return subprocess.run(["make", "-s", "image", f"CONTAINER={engine}"], cwd=ROOT, env=alone, capture_output=True, text=True,
                          timeout=60)


def _fake_engine(tmp_path: Path, info_status: int) -> Path:
    """A container engine's stand-in: ``info`` exits with ``info_status``; any other call writes its arguments."""
    engine = tmp_path / "engine"
    engine.write_text(f'#!/bin/sh\n[ "$1" = info ] && exit {info_status}\necho "$@" >> {tmp_path / "calls"}\n')
    engine.chmod(0o755)
    return engine


def test_make_image_refuses_in_one_line_without_an_engine_that_answers(tmp_path) -> None:
    missing = _make_image(tmp_path, str(tmp_path / "no-such-engine"))
    silent = _make_image(tmp_path, str(_fake_engine(tmp_path, info_status=1)))
    for done in (missing, silent):
        said = [line for line in done.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]  # make's own status
        assert done.returncode != 0 and done.stdout == "" and len(said) == 1, done
        assert "CONTAINER=" in done.stderr
    assert "needs a container engine" in missing.stderr and "does not answer" in silent.stderr
    assert not (tmp_path / "calls").exists()  # nothing was built


def test_make_image_builds_the_chapters_dockerfile_under_the_manifests_name(tmp_path) -> None:
    done = _make_image(tmp_path, str(_fake_engine(tmp_path, info_status=0)))
    assert done.returncode == 0, done.stderr
    (call,) = (tmp_path / "calls").read_text().splitlines()
    image = _manifest()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert call.split() == ["build", "-f", "chapters/ch09_scale_out/Dockerfile", "-t", image, "."]
