"""Session-scoped fixtures shared by the test modules.

- ``synthetic_logdir``: a logdir with known Memory Hierarchy values (``helpers.synthetic``).
- ``plugin_client(logdir, tuning=False)``: werkzeug test client on TensorBoard's real WSGI
  app with this plugin (loaded by its real loader; ``tuning`` sets
  ``--memory_hierarchy_tuning``) and a real (Python multiplexer) data provider over ``logdir``.
- ``tensorboard_server(logdir, load_fast=True, reload_interval=None, extra_args=())``: a real
  ``tensorboard`` process, one per (logdir, load_fast, reload_interval, extra_args) per
  session, stopped at session end.
- ``browser``: a Playwright Chromium (Debian's ``/usr/bin/chromium``), one per session.
- ``two_stage_logdir``: two short real demo runs written by the runtime, ZeRO stage 0
  (``stage0``, 4 steps) and stage 3 with the optimizer states on the host (``stage3``,
  6 steps), a tiny model each (about 1.5 min on 2 cores); the run diff's tests.

The test command runs the suite in two pytest-xdist workers (``-n 2 --dist loadgroup``,
scripts/run_tests.sh): most tests keep one core busy, and the machine has two.
:func:`pytest_collection_modifyitems` groups the tests by file, so a module's fixtures
are built once, and puts every file that uses the session's TensorBoard servers, browser
or trained logdirs in one group (:data:`SERVER_FILES`), so each server starts once.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from helpers import synthetic
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from werkzeug import test as werkzeug_test

from tb_plugin import metadata
from tb_plugin.loader import MemoryHierarchyLoader
from tb_plugin.plugin import MemoryHierarchyPlugin

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_TIMEOUT = 90.0  # seconds; TensorBoard starts in ~6-7 s on an idle machine
_SERVER_URL = re.compile(r"TensorBoard \S+ at (http://127\.0\.0\.1:(\d+))/")


@pytest.fixture(scope="session")
def synthetic_logdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A logdir with the runs of ``helpers.synthetic.RUNS``, ``NUM_STEPS`` steps each."""
    return synthetic.write_logdir(str(tmp_path_factory.mktemp("synthetic_logdir")))


def make_wsgi_app(
    logdir: str, tuning: bool | None = None, flags: dict | None = None
) -> application.TensorBoardWSGI:
    """TensorBoard's WSGI app with only this plugin, over a loaded Python data provider.

    Every step is kept (``tensor_size_guidance`` 0 for memory_hierarchy), as with
    ``--samples_per_plugin=memory_hierarchy=0``. With ``tuning`` (True or False) the
    plugin is built by its loader with ``--memory_hierarchy_tuning`` set so; with None
    (the default) the flag is absent and the plugin class is passed as such (tuning off).
    ``flags`` adds TensorBoard flags (for example ``{"host": "myhost", "bind_all": False}``).
    """
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={metadata.PLUGIN_NAME: 0}
    )
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    provider = tb_data_provider.MultiplexerDataProvider(multiplexer, logdir)
    flags = argparse.Namespace(
        logdir=logdir,
        path_prefix="",
        samples_per_plugin={metadata.PLUGIN_NAME: 0},
        window_title="",
        **(flags or {}),
    )
    if tuning is None:
        plugins: list = [MemoryHierarchyPlugin]
    else:
        flags.memory_hierarchy_tuning = bool(tuning)
        plugins = [MemoryHierarchyLoader()]
    return application.TensorBoardWSGIApp(flags, plugins, data_provider=provider)


@pytest.fixture(scope="session")
def plugin_client() -> Callable[[str], werkzeug_test.Client]:
    """Factory: ``plugin_client(logdir, tuning=None, flags=None)`` -> a werkzeug ``Client``
    on a freshly loaded app (see :func:`make_wsgi_app` for ``tuning`` and ``flags``)."""

    def make(
        logdir: str, tuning: bool | None = None, flags: dict | None = None
    ) -> werkzeug_test.Client:
        return werkzeug_test.Client(make_wsgi_app(str(logdir), tuning, flags))

    return make


@dataclass(frozen=True)
class TensorBoardServer:
    """A running ``tensorboard`` process started by the ``tensorboard_server`` fixture."""

    url: str  # "http://127.0.0.1:<port>", no trailing slash
    port: int
    logdir: str
    load_fast: bool
    log_path: Path  # the process's stdout and stderr

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log, for failure messages."""
        return self.log_path.read_text(errors="replace")[-chars:]


def _start_tensorboard(
    logdir: str,
    load_fast: bool,
    reload_interval: int | None,
    log_path: Path,
    extra_args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, TensorBoardServer]:
    """Start TensorBoard on a free port (``--port 0``) and wait for its plugin listing."""
    cmd = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        logdir,
        "--host",
        "127.0.0.1",
        "--port",
        "0",  # the OS picks a free port; the URL is read from the log
        f"--load_fast={'true' if load_fast else 'false'}",
        f"--samples_per_plugin={metadata.PLUGIN_NAME}=0",
    ]
    if reload_interval is not None:
        cmd.append(f"--reload_interval={reload_interval}")
    cmd.extend(extra_args)
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: TensorBoard + data server
        )
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _stop(proc)
            raise RuntimeError(
                f"tensorboard exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            )
        if url is None:
            match = _SERVER_URL.search(log_path.read_text(errors="replace"))
            url = match.group(1) if match else None
        if url is not None:
            try:
                with urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=5) as resp:
                    if resp.status == 200:
                        server = TensorBoardServer(
                            url, int(url.rsplit(":", 1)[1]), logdir, load_fast, log_path
                        )
                        return proc, server
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        time.sleep(0.25)
    _stop(proc)
    raise RuntimeError(
        f"tensorboard did not answer within {SERVER_START_TIMEOUT} s:\n"
        f"{log_path.read_text(errors='replace')[-3000:]}"
    )


def _stop(*procs: subprocess.Popen) -> None:
    """Stop servers started here: each one's own process group (TensorBoard and its data
    server). All are signalled first, then waited for, so they shut down in parallel."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        try:  # the Rust data server exits when TensorBoard closes its stdin; make sure
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def tensorboard_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., TensorBoardServer]]:
    """Factory: ``tensorboard_server(logdir, load_fast=True, reload_interval=None,
    extra_args=())``.

    Returns a :class:`TensorBoardServer`. Started with ``--host 127.0.0.1``, a free port,
    ``--load_fast=true|false`` and ``--samples_per_plugin=memory_hierarchy=0``
    (``--reload_interval`` too when given, seconds; then ``extra_args``, e.g.
    ``("--memory_hierarchy_tuning",)``); ready once ``/data/plugins_listing`` answers. One
    process per (logdir, load_fast, reload_interval, extra_args) per session; all are
    stopped at session end.
    """
    servers: dict[tuple, tuple[subprocess.Popen, TensorBoardServer]] = {}

    def get(
        logdir: str,
        load_fast: bool = True,
        reload_interval: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> TensorBoardServer:
        key = (str(Path(logdir).resolve()), bool(load_fast), reload_interval, tuple(extra_args))
        if key not in servers:
            log_path = tmp_path_factory.mktemp("tensorboard") / "server.log"
            servers[key] = _start_tensorboard(
                key[0], key[1], reload_interval, log_path, tuple(extra_args)
            )
        return servers[key][1]

    yield get
    _stop(*(proc for proc, _server in servers.values()))


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """A headless Chromium (Debian's, never a downloaded one) driven by Playwright."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield chromium
        finally:
            chromium.close()


REPO = Path(__file__).resolve().parent.parent
# The two runs of ``two_stage_logdir``: name -> (steps, extra ``--set`` overrides).
TWO_STAGE_RUNS = {
    "stage0": (4, ["stage=0"]),
    "stage3": (6, ["stage=3", "page_size_bytes=262144", 'offload_optimizer="cpu"']),
}


@pytest.fixture(scope="session")
def two_stage_logdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A logdir with the two short real training runs of :data:`TWO_STAGE_RUNS`
    (``python -m demo.train``, d_model 64, one block, 2 CPU replicas)."""
    logdir = tmp_path_factory.mktemp("two_stage_logs")
    # BFC: the allocator's peak is measured; no profiler traces (not needed, slower).
    quiet = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env = {**os.environ, **quiet, "ZERO_RUNTIME_PROFILE_EVERY": "0"}
    for run, (steps, sets) in TWO_STAGE_RUNS.items():
        cmd = [sys.executable, "-m", "demo.train", "--logdir", str(logdir), "--run", run]
        cmd += ["--steps", str(steps), "--d-model", "64", "--layers", "1"]
        for item in sets:
            cmd += ["--set", item]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(logdir)


#: Test files that use the session's TensorBoard servers, browser or trained logdirs
#: (``tensorboard_server``, ``browser``, ``two_stage_logdir``, the demo's and the main
#: job's runs): one xdist group, so each is made once in the run.
SERVER_FILES = frozenset(
    {
        "test_browser.py",
        "test_browser_diff.py",
        "test_e2e_demo.py",
        "test_main_job.py",
        "test_plugin.py",
        "test_plugin_checkpoints.py",
        "test_plugin_diff.py",
        "test_tuning_e2e.py",
        "test_tuning_multiworker.py",
        "test_whatif_browser.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test an ``xdist_group``: its file's name, or ``"servers"`` for the files
    in :data:`SERVER_FILES`. Only ``--dist loadgroup`` reads it (each group runs in one
    worker); without xdist the marks change nothing."""
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("servers" if name in SERVER_FILES else name))
