"""Shared fixtures. `wgpu` gives the WebGPU backend; without an adapter its tests skip, or
fail when GGWGPU_REQUIRE_ADAPTER=1 (as CI sets it): CI must never pass on skips."""
import os

import pytest

REQUIRE_ADAPTER = os.environ.get("GGWGPU_REQUIRE_ADAPTER") == "1"
# On a hardware GPU the backend would time the products of every test's shapes (thousands
# in the op matrix) and keep them in the user's cache: the tests force each kernel where
# they test one, and tests/test_tuning.py tests the timing itself.
os.environ.setdefault("GGWGPU_TUNE", "0")
_wgpu_cases = {"passed": 0, "failed": 0}


@pytest.fixture(scope="session")
def wgpu_session():
    from ggwgpu.backends import shared_wgpu_backend
    from ggwgpu.backends.wgpu_backend import NoAdapterError
    try:
        return shared_wgpu_backend()
    except NoAdapterError as e:
        if REQUIRE_ADAPTER:
            pytest.fail(f"GGWGPU_REQUIRE_ADAPTER=1 but {e}")
        pytest.skip(str(e))


@pytest.fixture
def adapter_as(monkeypatch):
    """adapter_as(info) makes auto decide as if the only adapter had `info` (None: no adapter
    at all); auto's cached decision is cleared before and after."""
    from ggwgpu import backends
    from ggwgpu.backends.wgpu_backend import NoAdapterError

    def set_adapter(info):
        def shared_adapter():
            if info is None:
                raise NoAdapterError("no WebGPU adapter: test")
            return type("Adapter", (), {"info": info})()
        monkeypatch.setattr(backends, "shared_adapter", shared_adapter)
        backends.auto_choice.cache_clear()
    yield set_adapter
    backends.auto_choice.cache_clear()


@pytest.fixture
def wgpu(wgpu_session, request):
    """The wgpu backend; counts the cases that ran on it for the closing summary."""
    yield wgpu_session
    failed = request.node.rep_call.failed if hasattr(request.node, "rep_call") else True
    _wgpu_cases["failed" if failed else "passed"] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep


def pytest_terminal_summary(terminalreporter):
    from ggwgpu.backends import shared_wgpu_backend
    if not sum(_wgpu_cases.values()):
        terminalreporter.write_line("wgpu: no test ran on a WebGPU adapter")
        return
    info = shared_wgpu_backend().info
    terminalreporter.write_line(
        f"wgpu: {_wgpu_cases['passed']} cases passed, {_wgpu_cases['failed']} failed on "
        f"adapter '{info.get('device')}' ({info.get('adapter_type')}, {info.get('backend_type')})")


# `import ggwgpu_cli` from a source checkout: pyproject installs the top-level cli/ folder
# under that name; without an install, register the folder under it here.
try:
    import ggwgpu_cli  # noqa: F401
except ModuleNotFoundError:
    import importlib.util
    import sys
    from pathlib import Path

    _cli_init = Path(__file__).resolve().parents[1] / "cli" / "__init__.py"
    _spec = importlib.util.spec_from_file_location(
        "ggwgpu_cli", _cli_init, submodule_search_locations=[str(_cli_init.parent)])
    sys.modules["ggwgpu_cli"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["ggwgpu_cli"])


def train_state(step=0, **extra) -> dict:
    """A minimal training state that ggwgpu.train.check_state accepts (checkpoint tests
    that are about other things store it): default options, a sample order at its start."""
    import dataclasses

    from ggwgpu.training import TrainOptions
    return {"step": step, "options": dataclasses.asdict(TrainOptions()),
            "data": {"version": 1, "seed": 0, "epoch": 0, "position": 0, "n_samples": 1,
                     "n_ctx": 4}, **extra}


@pytest.fixture
def slow_import(tmp_path, monkeypatch):
    """A function that imports a module whose import takes 0.6 s (the first time) and
    returns it: for the timers that must not cut an import."""
    import importlib
    import sys
    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(0.6)\ndone = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_module", raising=False)
    return lambda: importlib.import_module("slow_module")
